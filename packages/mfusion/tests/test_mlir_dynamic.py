"""mlir-cpu regions with symbolic outer dims: one kernel for every size, outputs allocated from
the call's inputs, row blocks cut per call, the measured choice taken at the traced sizes, and
explicit refusals for what stays static (a symbolic innermost dim; matmul regions with a
symbolic row count are in ``test_mlir_dynamic_gemm``)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mfusion
from mfusion import MFusionConfig
from mfusion.autofuse.fuse import auto_fuse
from mfusion.backends.mlir_cpu import format_out_spec, output_shapes
from mfusion.mlir import standalone
from mfusion.mlir.threads import block_bounds
from mfusion.report import GraphReport
from npu_core.timing import use_timer

REGION_OP = torch.ops.mfusion.mlir_region.default
HIDDEN = 48


def norm_gelu_residual(x, r, w, b):
    """LayerNorm -> erf-GELU -> residual add -> RMSNorm, as decomposed ops (rows of HIDDEN)."""
    m = x.mean(-1, keepdim=True)
    v = ((x - m) ** 2).mean(-1, keepdim=True)
    y = (x - m) * torch.rsqrt(v + 1e-5) * w + b
    h = 0.5 * y * (1 + torch.erf(y * 0.7071067811865476)) + r
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w


def _args(batch, seq):
    return (
        torch.randn(batch, seq, HIDDEN),
        torch.randn(batch, seq, HIDDEN),
        1 + 0.1 * torch.randn(HIDDEN),
        0.1 * torch.randn(HIDDEN),
    )


OUTER = ((0, 1), (0, 1), (), ())
SIZES = ((1, 1), (1, 7), (3, 43), (2, 129))  # rows 1, 7, 129, 258


def _fuse(gm, machine=None):
    record = GraphReport(0, "mlir-cpu")
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu", machine=machine), record)
    gm.recompile()
    return outlined, record


def test_one_kernel_runs_every_size(harness, monkeypatch):
    """The region is outlined once with dynamic outer dims; its outputs are allocated from the
    inputs' sizes, and every size (odd ones, one row) equals eager."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    gm = harness.trace_dynamic(norm_gelu_residual, *_args(2, 5), dynamic=OUTER)
    outlined, record = _fuse(gm, harness.machine("AVX2"))
    assert outlined == 1 and record.regions[0].outlined
    (call,) = [n for n in gm.graph.nodes if n.target is REGION_OP]
    ir, spec = call.args[1], call.args[2]
    assert "!torch.vtensor<[?,?,48],f32>" in ir
    assert spec == "f32:i0.0xi0.1x48"  # sizes read from input 0 per call
    for batch, seq in SIZES:
        args = _args(batch, seq)
        got = gm(*args)
        torch.testing.assert_close(got, norm_gelu_residual(*args), atol=1e-5, rtol=1e-5)


def test_out_spec_reads_symbolic_dims_from_inputs(harness):
    gm = harness.trace_dynamic(
        lambda x, w: (x * w).sum(-1), torch.randn(4, 8), torch.randn(8), dynamic=((0,), ())
    )
    x, w = (n.meta["val"] for n in gm.graph.find_nodes(op="placeholder"))
    (output,) = gm.graph.find_nodes(op="output")
    out = output.args[0].meta["val"]
    assert format_out_spec([out, w], [w, x]) == "f32:i1.0;f32:8"
    real = [torch.randn(8), torch.randn(13, 8)]
    assert output_shapes("f32:i1.0;f32:8", real) == [(torch.float32, [13]), (torch.float32, [8])]
    with pytest.raises(ValueError, match="is the size of no input dim"):
        format_out_spec([out], [w])


def test_block_bounds_cover_rows_without_empty_blocks():
    assert block_bounds(7, 2) == [(0, 4), (4, 3)]
    assert block_bounds(1, 2) == [(0, 1)]
    assert block_bounds(129, 4) == [(0, 33), (33, 32), (65, 32), (97, 32)]
    for rows in (1, 2, 5, 129):
        bounds = block_bounds(rows, 3)
        assert sum(n for _, n in bounds) == rows and all(n > 0 for _, n in bounds)
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(bounds))


def test_two_thread_profile_splits_dynamic_rows(harness, monkeypatch):
    """A two-thread machine profile runs the dynamic kernel on row blocks cut per call (odd
    counts, one row) and equals eager."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    gm = harness.trace_dynamic(norm_gelu_residual, *_args(6, 5), dynamic=OUTER)
    outlined, record = _fuse(gm, harness.machine("AVX2", {"threads": 2}))
    assert outlined == 1 and "2 row blocks on threads" in record.regions[0].reason
    (call,) = [n for n in gm.graph.nodes if n.target is REGION_OP]
    assert call.args[4] == call.args[1]  # the block kernel is the dynamic kernel itself
    for batch, seq in ((1, 3), (7, 2), (129, 1), (4, 4)):
        args = _args(batch, seq)
        got = gm(*args)
        torch.testing.assert_close(got, norm_gelu_residual(*args), atol=1e-5, rtol=1e-5)


def test_symbolic_inner_dim_is_refused_with_the_dim(harness, monkeypatch):
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    gm = harness.trace_dynamic(
        norm_gelu_residual, *_args(2, 5), dynamic=((0, 2), (0, 2), (0,), (0,))
    )
    inner = str(gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape[2])
    _, record = _fuse(gm, harness.machine("AVX2"))
    refused = [r.reason for r in record.regions if not r.outlined]
    assert len(refused) == 1, refused  # one line for the dim, however many nodes it reaches
    assert refused[0].startswith(f"refused: symbolic inner dim {inner} (dim 2) of ")
    assert refused[0].endswith("mlir-cpu vectorises a static innermost dim")
    # what is left are the (rows, 1) statistics pieces, whose inner dim is static
    for call in (n for n in gm.graph.nodes if n.target is REGION_OP):
        assert all(v.shape[-1] == 1 for v in call.meta["val"])
    for batch, seq, hidden in ((1, 5, 48), (3, 5, 33)):  # dims 0 and 2 symbolic
        args = (torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden))
        args += (torch.randn(hidden), torch.randn(hidden))
        torch.testing.assert_close(gm(*args), norm_gelu_residual(*args), atol=1e-5, rtol=1e-5)


def test_region_reading_a_symbolic_size_stays_with_inductor(harness, monkeypatch):
    """A view of a dynamic shape takes its sizes from the graph: the call passes tensors only,
    so the region is refused with the size it reads, and the graph still equals eager."""
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")

    def flatten_rows(x):
        return torch.exp(x).view(x.shape[0] * x.shape[1], HIDDEN) * 2.0

    gm = harness.trace_dynamic(flatten_rows, torch.randn(2, 3, HIDDEN), dynamic=((0, 1),))
    outlined, record = _fuse(gm, harness.machine("AVX2"))
    assert outlined == 0
    assert any("region reads the symbolic size" in r.reason for r in record.regions), record
    x = torch.randn(5, 7, HIDDEN)
    torch.testing.assert_close(gm(x), flatten_rows(x))


def test_choice_is_measured_at_the_hint_size(harness, tmp_path, monkeypatch):
    """The measured choice times the dynamic kernel and Inductor's kernel for the same dynamic
    region on inputs of the traced (hint) sizes (the injected timer runs both once)."""
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MFUSION_MLIR_CHOICE", raising=False)
    gm = harness.trace_dynamic(norm_gelu_residual, *_args(3, 5), dynamic=OUTER)
    assert [tuple(t.shape) for t in standalone.example_inputs(gm)] == [
        (3, 5, HIDDEN),
        (3, 5, HIDDEN),
        (HIDDEN,),
        (HIDDEN,),
    ]
    timer = harness.fixed_timer(1e-6, 2e-6)
    with use_timer(timer):
        outlined, record = _fuse(gm, harness.machine("AVX2"))
    assert outlined == 1 and timer.calls == 2  # the region, then the whole graph
    assert "mlir 1.0 us vs inductor 2.0 us" in record.regions[0].reason
    assert record.whole_graph.startswith("regions kept")
    args = _args(5, 3)
    torch.testing.assert_close(gm(*args), norm_gelu_residual(*args), atol=1e-5, rtol=1e-5)


class NormBlock(nn.Module):
    """LayerNorm -> GELU -> residual -> RMSNorm over rows of HIDDEN (nn modules, as users
    write them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.rms = nn.RMSNorm(HIDDEN, eps=1e-6)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.rms(F.gelu(self.ln(x)) + r)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic-dynamic"])
def test_compiled_model_runs_every_size_without_recompiling(
    harness, tmp_path, monkeypatch, dynamic
):
    """``torch.compile(dynamic=True)`` (or the automatic-dynamic recompile after a second shape)
    outlines the row region once and runs 1, 7, 129 and 258 rows without another compile."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as shape_config

    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MFUSION_MLIR_CHOICE", raising=False)
    torch._dynamo.reset()
    counters.clear()
    model = NormBlock().eval()
    machine = harness.machine("AVX2")
    options = mfusion.compile_options(backend="mlir-cpu", machine=machine)
    compiled = torch.compile(model, dynamic=dynamic, options=options)
    # Dynamo specialises sizes 0 and 1 unless told not to: one row must not recompile
    with (
        shape_config.patch(backed_size_oblivious=True),
        use_timer(harness.fixed_timer(1e-6, 2e-6)),
        torch.no_grad(),
    ):
        warmup = [(2, 3), (3, 5)] if dynamic is None else [(2, 3)]
        for batch, seq in [*warmup, *SIZES]:
            x, r = torch.randn(batch, seq, HIDDEN), torch.randn(batch, seq, HIDDEN)
            torch.testing.assert_close(compiled(x, r), model(x, r), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == len(warmup)
    last = mfusion.report()[-1]
    # var_mean (LayerNorm's statistics) is outside the table: the rest is one or two regions
    assert last.regions and all(r.outlined for r in last.regions), last.summary()
    assert "mlir 1.0 us vs inductor 2.0 us" in last.regions[0].reason
    torch._dynamo.reset()
