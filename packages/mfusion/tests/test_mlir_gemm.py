"""Matmul + epilogue regions in the mlir-cpu backend: the tiled GEMM equals eager (shapes that
are not multiples of the blocks, K not a multiple of anything, a transposed weight, the
epilogues), it is register-blocked vector code, and the measured choice handles the class (a
GEMM region slower than Inductor's stays in the graph, a faster one is outlined). Timers are
injected, so no outcome depends on the speed of the machine."""

from __future__ import annotations

import pytest
import torch

from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.mlir.gemm import gemm_script, largest_divisor, row_block
from mfusion.mlir.importer import import_region
from mfusion.mlir.pipeline import lower_to_llvm
from mfusion.mlir.runtime import CompiledRegion
from mfusion.mlir.threads import row_split
from mfusion.report import GraphReport
from npu_core.timing import use_timer

REGION_OP = torch.ops.mfusion.mlir_region.default


def linear_gelu_erf(x, w, b):
    y = torch.addmm(b, x, w.permute(1, 0))
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def mm_gelu_tanh(x, w):
    y = x @ w
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def linear_silu(x, w, b):
    y = x @ w.permute(1, 0) + b
    return y * torch.sigmoid(y)


def mm_relu_residual(x, w, r):
    return torch.relu(x @ w) + r


CASES = {
    # blocks divide: 4-row blocks, 16-column panels
    "linear_gelu_erf_16x64x96": (linear_gelu_erf, (16, 64, 96), True),
    # M, N, K not multiples of 4/16/8: 4-row blocks and a peeled 3-row block, N 20 -> 10-column
    # panels, K 37
    "linear_gelu_erf_15x37x20": (linear_gelu_erf, (15, 37, 20), True),
    # prime M and N: 4-row blocks and a 1-row remainder, 1-column panels, still correct
    "mm_gelu_tanh_13x29x7": (mm_gelu_tanh, (13, 29, 7), False),
    # a ViT-like token count (197 = 49 x 4 + 1) and M below one block
    "linear_gelu_erf_197x24x32": (linear_gelu_erf, (197, 24, 32), True),
    "mm_relu_residual_3x16x32": (mm_relu_residual, (3, 16, 32), False),
    # K == M: the packed weight must not share the output's buffer
    "linear_silu_64x64x64": (linear_silu, (64, 64, 64), True),
    "mm_relu_residual_24x100x72": (mm_relu_residual, (24, 100, 72), False),
}


def _args(fn, m: int, k: int, n: int, transposed: bool) -> tuple[torch.Tensor, ...]:
    x = torch.randn(m, k)
    w = torch.randn(n, k) if transposed else torch.randn(k, n)
    w = w / k**0.5
    if fn is mm_gelu_tanh:
        return x, w
    if fn is mm_relu_residual:
        return x, w, torch.randn(m, n)
    return x, w, torch.randn(n)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gemm_region_matches_eager(harness, name):
    fn, (m, k, n), transposed = CASES[name]
    torch.manual_seed(0)
    args = _args(fn, m, k, n, transposed)
    region = CompiledRegion(import_region(harness.trace(fn, *args)), "vector")
    out = torch.empty(m, n)
    region(list(args), [out])
    # the reference in float64: the GEMM sums in another order than eager's BLAS
    expected = fn(*(a.double() for a in args)).float()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, fn(*args), atol=1e-4, rtol=1e-4)


def test_gemm_region_is_register_blocked_vector_code(harness):
    fn, (m, k, n), transposed = CASES["linear_gelu_erf_16x64x96"]
    ir = import_region(harness.trace(fn, *_args(fn, m, k, n, transposed)))
    lowered = str(lower_to_llvm(ir, "vector"))
    assert "vector<16xf32>" in lowered  # a 16-column panel row per K step
    assert "contract" in lowered  # multiply-adds may become FMAs
    assert "memrefCopy" not in lowered  # the packed panel is written in place


def test_gemm_region_is_not_split_into_row_blocks(harness):
    """With K == M a plain mm's weight has as many rows as the output: splitting it with the
    rows would be wrong, so matmul regions run on one thread."""
    gm = harness.trace(mm_relu_residual, torch.randn(8, 8), torch.randn(8, 16), torch.randn(8, 16))
    assert row_split(gm) is None


@pytest.mark.parametrize(
    ("extent", "limit", "expected"), [(256, 8, 8), (20, 8, 5), (13, 8, 1), (48, 32, 24), (3, 32, 3)]
)
def test_largest_divisor(extent, limit, expected):
    assert largest_divisor(extent, limit) == expected


@pytest.mark.parametrize(
    ("m", "expected"),
    [(256, (4, False)), (197, (4, True)), (13, (4, True)), (4, (4, False)), (3, (3, False))],
)
def test_row_blocks_peel_a_ragged_last_block(m, expected):
    """Rows that are not a multiple of the block keep full blocks (not 1-row ones, as a
    divisor would give 13 or 197) and run the remainder in a peeled loop."""
    assert row_block(m) == expected
    assert ("transform.loop.peel" in gemm_script(m, 32, 16, True)) is expected[1]


@pytest.fixture
def decisions(tmp_path, monkeypatch):
    """A private decision cache, measured mode."""
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MFUSION_MLIR_CHOICE", raising=False)
    return tmp_path / "mlir-choice"


ARGS = (torch.randn(16, 40), torch.randn(48, 40) / 40**0.5, torch.randn(48))


def _fuse(harness):
    gm = harness.trace(linear_gelu_erf, *ARGS)
    record = GraphReport(0, "mlir-cpu")
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu"), record)
    gm.recompile()
    return gm, outlined, record


@pytest.mark.slow
def test_slower_gemm_region_stays_with_inductor(harness, decisions):
    timer = harness.fixed_timer(3e-6, 2e-6)
    with use_timer(timer):
        gm, outlined, record = _fuse(harness)
    assert outlined == 0 and timer.calls == 1
    assert [r.kind for r in record.regions] == ["matmul"]
    assert record.regions[0].reason.startswith("stays with Inductor, inductor: mlir 3.0 us")
    assert harness.count(gm, REGION_OP) == 0
    assert harness.count(gm, torch.ops.aten.addmm.default) == 1
    torch.testing.assert_close(gm(*ARGS), linear_gelu_erf(*ARGS), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_faster_gemm_region_is_outlined_and_matches_eager(harness, decisions):
    timer = harness.fixed_timer(1e-6, 2e-6)
    with use_timer(timer):
        gm, outlined, record = _fuse(harness)
    assert outlined == 1 and record.regions[0].kind == "matmul"
    assert harness.count(gm, REGION_OP) == 1
    assert harness.count(gm, torch.ops.aten.addmm.default) == 0
    torch.testing.assert_close(gm(*ARGS), linear_gelu_erf(*ARGS), atol=1e-4, rtol=1e-4)
