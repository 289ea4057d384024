"""Torch-MLIR bridge: FX region -> torch dialect -> linalg -> LLVM JIT, checked against eager."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.backends.registry import get_backend
from mfusion.mlir.importer import import_region
from mfusion.mlir.runtime import compiled_region
from mfusion.report import GraphReport


def rms_tanh(x, w):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    return torch.tanh(y) + 1.0, y.sum(0)


def test_import_produces_torch_dialect(harness):
    gm = harness.trace(rms_tanh, torch.randn(8, 32), torch.randn(32))
    ir = import_region(gm)
    assert "func.func @region" in ir and "torch.aten.rsqrt" in ir
    assert "!torch.vtensor<[8,32],f32>" in ir


def test_import_keeps_symbolic_dims_dynamic(harness):
    """A graph traced with symbolic shapes imports with dynamic dims."""
    gm = harness.trace(rms_tanh, torch.randn(8, 32), torch.randn(32), mode="symbolic")
    ir = import_region(gm)
    assert "!torch.vtensor<[?,?],f32>" in ir


def test_jit_region_matches_eager_with_two_outputs(harness):
    x, w = torch.randn(16, 64), torch.randn(64)
    region = compiled_region(import_region(harness.trace(rms_tanh, x, w)))
    outputs = [torch.empty(16, 64), torch.empty(64)]
    region([x, w], outputs)
    for got, ref in zip(outputs, rms_tanh(x, w), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_jit_region_is_cached_by_ir(harness):
    ir = import_region(harness.trace(rms_tanh, torch.randn(4, 8), torch.randn(8)))
    assert compiled_region(ir) is compiled_region(ir)


def test_jit_handles_non_contiguous_input(harness):
    x, w = torch.randn(32, 16).t(), torch.randn(32)
    region = compiled_region(import_region(harness.trace(rms_tanh, x.contiguous(), w)))
    outputs = [torch.empty(16, 32), torch.empty(32)]
    region([x, w], outputs)
    torch.testing.assert_close(outputs[0], rms_tanh(x, w)[0], atol=1e-5, rtol=1e-5)


# LLVM dialect that the LLVM IR translation refuses (a cast no conversion removed), as a vector
# lowering that left one behind produced it in ResNet-18's training compile
_UNTRANSLATABLE = """module {
  llvm.func @f() -> i32 attributes {llvm.emit_c_interface} {
    %0 = builtin.unrealized_conversion_cast to i32
    llvm.return %0 : i32
  }
}"""


def test_engine_failure_names_mlirs_reason_and_prints_nothing(capfd):
    """A module the JIT cannot translate raises with MLIR's own message (the caller reports it
    and tries the next pipeline), and MLIR's default handler does not print it to stderr."""
    from torch_mlir import ir

    from mfusion.mlir.runtime import _engine

    module = ir.Module.parse(_UNTRANSLATABLE, ir.Context())
    with pytest.raises(RuntimeError, match="LLVM Translation failed for operation"):
        _engine(module, opt_level=3)
    assert "LLVM Translation failed" not in capfd.readouterr().err


def test_mlir_cpu_backend_outlines_region_and_matches_eager(harness, monkeypatch):
    """auto_fuse with mlir-cpu replaces the fp32 region by one mfusion::mlir_region call."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")

    def fn(x, w, m):
        y = torch.exp(x) * w - 1.0
        return (y @ m).sum(), torch.sigmoid(y)

    args = (torch.randn(8, 16), torch.randn(16), torch.randn(16, 4))
    gm = harness.trace(fn, *args)
    record = GraphReport(0, "mlir-cpu")
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu"), record)
    gm.recompile()
    assert outlined >= 1
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.mfusion.mlir_region.default]
    assert len(calls) == outlined
    assert any(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)  # stays outside
    for got, ref in zip(gm(*args), fn(*args), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_mlir_cpu_declines_bf16_region(harness):
    """A region outside the capability table is not outlined: it stays with Inductor."""
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    gm = harness.trace(lambda x: torch.exp(x) * 2 + 1, x)
    record = GraphReport(0, "mlir-cpu")
    assert auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu"), record) == 0
    assert not any(n.target is torch.ops.mfusion.mlir_region.default for n in gm.graph.nodes)


def test_npu_backend_is_cleanly_unavailable_here():
    from npu_core.plugins import PluginError

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    # the declared device is checked before the install probe (npu_core.plugins' rule)
    with pytest.raises(
        PluginError, match=r"'npu' cannot run this call: device 'cpu' \(allowed: npu\)"
    ):
        get_backend("npu")
