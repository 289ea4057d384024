"""Registries are complete: every pass and backend is importable, tested and lowerable."""

from __future__ import annotations

from pathlib import Path

import pytest

from mfusion import PASS_REGISTRY
from mfusion.backends.registry import BACKEND_REGISTRY, backend_class
from mfusion.passes.registry import build_pass

TESTS = Path(__file__).parent


def test_every_pass_builds_with_its_registered_name():
    for name in PASS_REGISTRY:
        assert build_pass(name).name == name


def test_every_pass_has_a_test_that_runs_it():
    """A pass is only registered with a test that applies it by name."""
    sources = "".join(p.read_text() for p in TESTS.glob("test_*_passes.py"))
    missing = [name for name in PASS_REGISTRY if f'"{name}"' not in sources]
    assert not missing, f"passes without tests: {missing}"


def test_every_backend_resolves_to_a_class_with_a_table():
    for name in BACKEND_REGISTRY:
        cls = backend_class(name)
        assert cls.name == name and cls.table.backend == name


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown pass 'fold'"):
        build_pass("fold")
    with pytest.raises(ValueError, match="backend 'tpu' is not known"):
        backend_class("tpu")


def test_emit_refuses_ops_inductor_cannot_lower():
    """Passes can only emit ops Inductor lowers itself (never an opaque eager fallback)."""
    import torch
    from torch import fx

    from mfusion.passes._graph import emit

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    with pytest.raises(ValueError, match="no Inductor lowering"):
        emit(graph, torch.ops.aten.gelu.default, x)


def test_auto_backend_resolves_to_inductor_without_npu():
    from mfusion import MFusionConfig
    from mfusion.backends.npu import NPUBackend

    expected = "npu" if NPUBackend.is_available() else "inductor"
    assert MFusionConfig().resolved_backend() == expected
