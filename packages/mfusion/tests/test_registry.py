"""Registries are complete and the package has no import cycles.

Expected values come from outside the code under test: the pass files on disk, the backends the
README documents, torch_npu itself, and an import graph read from the source with ``ast``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

import mfusion
from mfusion import PASS_REGISTRY
from mfusion.backends.registry import BACKEND_REGISTRY, BACKENDS, backend_class, select_backend
from mfusion.passes.manager import build_pass
from npu_core.plugins import DeviceDtype, PluginError

TESTS = Path(__file__).parent
SOURCE = Path(mfusion.__file__).parent
# Modules of mfusion/passes/ that are infrastructure, not passes.
NOT_PASSES = {"base", "cleanup", "manager", "registry"}
"""Modules of ``passes/`` that are not passes; private ``_*`` modules are shared helpers."""


def test_every_pass_file_is_registered_and_builds_under_its_name():
    """The reference is the directory listing: one file per pass, named after the pass."""
    modules = {p.stem for p in (SOURCE / "passes").glob("*.py") if not p.stem.startswith("_")}
    on_disk = modules - NOT_PASSES
    assert set(PASS_REGISTRY) == on_disk
    for name in on_disk:
        graph_pass = build_pass(name)
        assert graph_pass.name == name
        assert type(graph_pass).__module__ == f"mfusion.passes.{name}"


def test_every_pass_has_a_test_that_runs_it():
    """A pass is only registered with a test that applies it by name."""
    sources = "".join(p.read_text() for p in TESTS.glob("test_*_passes.py"))
    missing = [name for name in PASS_REGISTRY if f'"{name}"' not in sources]
    assert not missing, f"passes without tests: {missing}"


def test_backends_are_the_documented_ones_with_their_own_tables():
    assert set(BACKEND_REGISTRY) == {"inductor", "mlir-cpu", "npu"}
    assert list(BACKENDS.names()) == ["npu", "inductor", "mlir-cpu"]  # preference order
    for name in ("inductor", "mlir-cpu", "npu"):
        cls = backend_class(name)
        assert cls.name == name and cls.table.backend == name


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match=r"pass 'fold' is not known; available passes: .*'gelu'"):
        build_pass("fold")
    with pytest.raises(ValueError, match="backend 'tpu' is not known"):
        backend_class("tpu")
    with pytest.raises(ValueError, match="backend='tpu' is not known; use one of: auto, "):
        mfusion.MFusionConfig(backend="tpu")


def test_emit_refuses_ops_inductor_cannot_lower():
    """Passes can only emit ops Inductor lowers itself (never an opaque eager fallback)."""
    from torch import fx

    from mfusion.passes._graph import emit

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    with pytest.raises(ValueError, match="no Inductor lowering"):
        emit(graph, torch.ops.aten.gelu.default, x)


def _npu_device_visible() -> bool:
    """Asked of torch_npu directly, not through mfusion or npu_core."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available() and torch.npu.device_count() > 0


def test_auto_backend_is_npu_exactly_where_torch_npu_sees_a_device():
    from mfusion import MFusionConfig

    expected = "npu" if _npu_device_visible() else "inductor"
    assert MFusionConfig().resolved_backend() == expected


def test_backend_choice_follows_the_plugin_rule_and_is_logged(caplog):
    """auto = first installed backend accepting the device; mlir-cpu only when named; a named
    backend that cannot run is an error saying why; each choice is logged once."""
    npu = BACKENDS.get("npu")
    fake_npu = dataclasses.replace(npu, installed=lambda: None, constraints=DeviceDtype())
    BACKENDS.register(fake_npu, replace=True)  # an NPU that is "there" (and clears the log)
    try:
        with caplog.at_level(logging.INFO, logger="npu_core.plugins"):
            assert select_backend("auto") == "npu"
        assert "mfusion kernel backend npu" in caplog.text
    finally:
        BACKENDS.register(npu, replace=True)
    torch_mlir_there = importlib.util.find_spec("torch_mlir") is not None
    assert select_backend("auto") == ("npu" if _npu_device_visible() else "inductor")
    if torch_mlir_there:
        assert select_backend("mlir-cpu") == "mlir-cpu"
    mlir = BACKENDS.get("mlir-cpu")
    BACKENDS.register(dataclasses.replace(mlir, installed=lambda: "no JIT here"), replace=True)
    try:
        with pytest.raises(PluginError, match=r"'mlir-cpu' cannot run this call: .*no JIT here"):
            select_backend("mlir-cpu")
        assert select_backend("auto") != "mlir-cpu"
    finally:
        BACKENDS.register(mlir, replace=True)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (never executed)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
            yield from (n for stmt in child.orelse for n in [stmt, *_runtime_nodes(stmt)])
            continue
        yield child
        yield from _runtime_nodes(child)


def _imports(path: Path, module: str) -> set[str]:
    """mfusion modules imported anywhere in ``path`` (top level or inside functions)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: relative import")
    return {name for name in found if name.split(".")[0] == "mfusion"}


def _module_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports, read from the source under ``root``."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return {name: _imports(path, name) & set(modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge found by a depth-first search, as the cycle it closes."""
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def _without_package_init(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # The package __init__ re-exports: importing any submodule runs it first by Python's rules,
    # and it imports everything, so its edges say nothing about the modules' own structure.
    return {m: deps - {"mfusion"} for m, deps in graph.items() if m != "mfusion"}


def test_no_import_cycles_between_modules():
    """Every import, lazy ones inside functions included, forms a DAG."""
    cycles = _cycles(_without_package_init(_module_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_config_is_a_leaf_and_the_registry_is_data():
    graph = _module_graph()
    assert graph["mfusion.passes.registry"] == set()
    assert graph["mfusion.config"] <= {
        "mfusion.machine",
        "mfusion.passes.registry",
        "mfusion.backends.registry",
    }
    assert graph["mfusion.backends.registry"] == set()
    assert graph["mfusion.machine"] == set()


def test_the_cycle_detector_finds_a_planted_cycle(tmp_path):
    """The checks above can fail: a lazy a -> b -> a cycle in a planted package is reported."""
    pkg = tmp_path / "mfusion"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from mfusion.a import x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from mfusion.sub.b import x\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mfusion.c import z\n"
        "def f():\n    from mfusion.a import y\n"
    )
    (pkg / "c.py").write_text("from mfusion.sub.b import f\n")
    graph = _module_graph(pkg)
    assert graph["mfusion.sub.b"] == {"mfusion.a"}
    assert _cycles(_without_package_init(graph)) == [["mfusion.a", "mfusion.sub.b", "mfusion.a"]]
