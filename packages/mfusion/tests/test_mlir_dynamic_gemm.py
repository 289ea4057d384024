"""mlir-cpu matmul + epilogue regions with a symbolic row count M (tokens) and a static K and N
(the weights): one kernel for every M, 4-row blocks to a dynamic bound and the M mod 4 rest in
1-row blocks, every tile static and vectorised; a symbolic K or N is still refused with the dim.
References are eager PyTorch (float64 for the kernel itself: it sums in another order)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mfusion
from mfusion import MFusionConfig
from mfusion.autofuse.capability import MLIR_CPU_TABLE, ShapeRefusal
from mfusion.autofuse.fuse import auto_fuse
from mfusion.mlir.gemm import DYNAMIC, gemm_script, row_block
from mfusion.mlir.importer import import_region
from mfusion.mlir.runtime import CompiledRegion
from mfusion.report import GraphReport
from npu_core.timing import use_timer

REGION_OP = torch.ops.mfusion.mlir_region.default
K, N = 40, 48
ROWS = (1, 3, 7, 129, 258)  # below one block, a rest only, a block and a rest, 4k+1, 4k+2


def linear_gelu(x, w, b):
    y = torch.addmm(b, x, w.permute(1, 0))
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def linear_residual(x, w, b, r):
    return torch.addmm(b, x, w.permute(1, 0)) + r


def _args(fn, m: int) -> tuple[torch.Tensor, ...]:
    weights = (torch.randn(N, K) / K**0.5, torch.randn(N))
    residual = (torch.randn(m, N),) if fn is linear_residual else ()
    return (torch.randn(m, K), *weights, *residual)


def _rows_dynamic(fn) -> tuple[tuple[int, ...], ...]:
    """M symbolic in the input (and the residual), the weight and bias static."""
    return ((0,), (), (), (0,)) if fn is linear_residual else ((0,), (), ())


def _fuse(gm, machine):
    record = GraphReport(0, "mlir-cpu")
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu", machine=machine), record)
    gm.recompile()
    return outlined, record


@pytest.mark.parametrize("fn", [linear_gelu, linear_residual], ids=lambda f: f.__name__)
def test_symbolic_rows_outline_one_gemm_kernel_for_every_m(harness, monkeypatch, fn):
    """The region (matmul and epilogue) is outlined once with a ``?`` row count, its output
    sized from the input per call, and every M equals eager."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    torch.manual_seed(0)
    gm = harness.trace_dynamic(fn, *_args(fn, 9), dynamic=_rows_dynamic(fn))
    outlined, record = _fuse(gm, harness.machine("AVX2"))
    assert outlined == 1 and [r.kind for r in record.regions] == ["matmul"], record
    assert harness.count(gm, torch.ops.aten.addmm.default) == 0
    (call,) = [n for n in gm.graph.nodes if n.target is REGION_OP]
    ir, spec, pipeline = call.args[1], call.args[2], call.args[3]
    assert f"!torch.vtensor<[?,{K}],f32>" in ir
    assert re.fullmatch(rf"f32:i\d\.0x{N}", spec)  # M read from an input per call
    assert pipeline == "vector"  # no scalar fallback
    for m in ROWS:
        args = _args(fn, m)
        got = gm(*args)
        expected = fn(*(a.double() for a in args)).float()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got, fn(*args), atol=1e-4, rtol=1e-4)


def test_dynamic_rows_take_the_blocked_lowering(harness):
    """Both row loops are register-blocked vector code: 4 x 16 accumulators in the full
    blocks, 16-wide rows in the rest, no masks and no linalg op left for scalar loops."""
    from torch_mlir import ir
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d

    from mfusion.mlir.gemm import tile_matmul_epilogue
    from mfusion.mlir.vectorize import expand_transcendentals

    gm = harness.trace_dynamic(linear_gelu, *_args(linear_gelu, 9), dynamic=((0,), (), ()))
    asm = import_region(gm)
    context = ir.Context()
    torch_d.register_dialect(context)
    module = ir.Module.parse(asm, context)
    run_pipeline_with_repro_report(
        module,
        "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline,"
        "func.func(linalg-fuse-elementwise-ops),func.func(canonicalize))",
        "to linalg",
    )
    expand_transcendentals(module)
    tile_matmul_epilogue(module)
    tiled = str(module)
    assert "linalg." not in tiled and "vector.mask" not in tiled
    assert "vector<4x16xf32>" in tiled  # a full block's accumulator
    assert "vector<1x16xf32>" in tiled or "vector<16xf32>" in tiled  # a 1-row block's
    kernel = CompiledRegion(asm, "vector")
    assert kernel.dynamic and kernel.pipeline == "vector"


def test_dynamic_m_always_peels_into_one_row_blocks():
    assert row_block(DYNAMIC) == (4, True)
    script = gemm_script(DYNAMIC, 48, 40, True)
    assert "transform.loop.peel" in script and "tile_sizes [1, 0]" in script
    assert "tile_sizes [1, 0]" not in gemm_script(13, 48, 40, True)  # a static rest is static


@pytest.mark.parametrize(
    ("dynamic", "where"),
    [
        (((0,), (0,), (0,)), "(dim 1) of addmm's output"),
        (((0, 1), (1,), ()), "(dim 1) of addmm's input"),
    ],
    ids=["symbolic-n", "symbolic-k"],
)
def test_symbolic_k_or_n_is_refused_with_the_dim(harness, monkeypatch, dynamic, where):
    """The packed panels are cut from K and N: a matmul with a symbolic one is refused, naming
    the dim, it stays in the graph, and the graph still equals eager."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    gm = harness.trace_dynamic(linear_gelu, *_args(linear_gelu, 9), dynamic=dynamic)
    (addmm,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    refusal = MLIR_CPU_TABLE.check(addmm)
    assert isinstance(refusal, ShapeRefusal) and where in refusal
    assert refusal.endswith("mlir-cpu compiles matmul ops with a static K and N")
    _outlined, record = _fuse(gm, harness.machine("AVX2"))
    refused = [r.reason for r in record.regions if r.reason.startswith("refused:")]
    assert any(f"symbolic inner dim {refusal.dim} " in r or refusal in r for r in refused)
    assert harness.count(gm, torch.ops.aten.addmm.default) == 1
    args = _args(linear_gelu, 11)
    torch.testing.assert_close(gm(*args), linear_gelu(*args), atol=1e-4, rtol=1e-4)


class LinearBlock(nn.Module):
    """Linear -> GELU, then Linear + residual, over a tokens x hidden activation."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(K, N)
        self.down = nn.Linear(N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) + x


@pytest.mark.slow
def test_compiled_linear_block_runs_every_token_count_without_recompiling(
    harness, tmp_path, monkeypatch
):
    """``torch.compile(dynamic=True)`` outlines both GEMM regions once and runs 1, 3, 7, 129
    and 258 tokens on them without another compile."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as shape_config

    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LinearBlock().eval()
    options = mfusion.compile_options(backend="mlir-cpu", machine=harness.machine("AVX2"))
    compiled = torch.compile(model, dynamic=True, options=options)
    # Dynamo specialises sizes 0 and 1 unless told not to: one token must not recompile
    with (
        shape_config.patch(backed_size_oblivious=True),
        use_timer(harness.fixed_timer(1e-6, 2e-6)),
        torch.no_grad(),
    ):
        for m in (5, *ROWS):
            x = torch.randn(m, K)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    last = mfusion.report()[-1]
    gemms = [r for r in last.regions if r.kind == "matmul"]
    assert len(gemms) == 2 and all(r.outlined for r in gemms), last.summary()
    torch._dynamo.reset()
