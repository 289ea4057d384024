"""GEMM regions as a compiled graph hands them over: the weight's ``permute`` and the 3-D views
of a transformer's linear. The region must take the weight itself (not a transposed view the
call would copy, read through unpacked panels) and must lower in its 2-D form with the blocked
GEMM strategy, not the scalar fallback; results equal eager. Decisions are forced
(``MFUSION_MLIR_CHOICE=always``): no outcome depends on the speed of the machine."""

from __future__ import annotations

import logging

import pytest
import torch

from mfusion import MFusionConfig
from mfusion.autofuse.capability import MLIR_CPU_TABLE
from mfusion.autofuse.cluster import grow_regions
from mfusion.autofuse.fuse import auto_fuse, candidate_kinds
from mfusion.mlir.flatten import flatten_gemm_region, rows_form
from mfusion.mlir.importer import import_region
from mfusion.mlir.pipeline import lower_to_llvm
from mfusion.mlir.runtime import CompiledRegion, signature_shapes
from mfusion.report import GraphReport

aten = torch.ops.aten
REGION_OP = torch.ops.mfusion.mlir_region.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def linear_gelu(x, w, b):
    """A linear written as Dynamo hands it to Inductor: the weight transposed by a permute."""
    y = torch.addmm(b, x, w.permute(1, 0))
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def bert_output(x, w, b, residual):
    """BERT's attention/FFN output: 3-D activations flattened for the addmm, the result viewed
    back to 3-D for the residual add."""
    batch, tokens, hidden = x.shape
    y = torch.addmm(b, x.reshape(batch * tokens, hidden), w.permute(1, 0))
    return y.reshape(batch, tokens, w.shape[0]) + residual


def bert_intermediate(x, w, b):
    """BERT's FFN up-projection: the GELU runs on the 3-D view, flattened again after it."""
    y = torch.addmm(b, x, w.permute(1, 0)).reshape(2, x.shape[0] // 2, w.shape[0])
    return (0.5 * y * (1 + torch.erf(y * 0.7071067811865476))).reshape(x.shape[0], w.shape[0])


def _bert_output_args() -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(2, 8, 32),
        torch.randn(48, 32) / 32**0.5,
        torch.randn(48),
        torch.randn(2, 8, 48),
    )


def _bert_intermediate_args() -> tuple[torch.Tensor, ...]:
    return torch.randn(16, 32), torch.randn(64, 32) / 32**0.5, torch.randn(64)


def _linear_gelu_args() -> tuple[torch.Tensor, ...]:
    return torch.randn(16, 40), torch.randn(48, 40) / 40**0.5, torch.randn(48)


def test_matmul_region_takes_the_weight_permute(harness):
    gm = harness.trace(linear_gelu, *_linear_gelu_args())
    kinds = candidate_kinds(gm.graph, MLIR_CPU_TABLE)
    (region,) = grow_regions(gm.graph, kinds, max_ops=16)
    targets = [n.target for n in region.nodes]
    assert aten.permute.default in targets and aten.addmm.default in targets


def test_a_shared_weight_view_stays_out(harness):
    """A view also read outside the region would become a region output: it stays out."""

    def shared(x, w):
        wt = w.permute(1, 0)
        return torch.relu(x @ wt), wt * 2

    gm = harness.trace(shared, torch.randn(4, 8), torch.randn(8, 8))
    kinds = candidate_kinds(gm.graph, MLIR_CPU_TABLE)
    for region in grow_regions(gm.graph, kinds, max_ops=16):
        targets = [n.target for n in region.nodes]
        assert not (aten.permute.default in targets and aten.mm.default in targets)


BERT_REGIONS = pytest.mark.parametrize(
    ("fn", "make"),
    [(bert_output, _bert_output_args), (bert_intermediate, _bert_intermediate_args)],
    ids=["output_residual", "intermediate_gelu"],
)
"""BERT's two GEMM regions (attention output + residual, FFN up + GELU) with 3-D views."""


@BERT_REGIONS
def test_3d_views_are_dropped_in_the_2d_form(harness, fn, make):
    torch.manual_seed(0)
    args = make()
    flat = flatten_gemm_region(harness.trace(fn, *args))
    assert flat is not None
    assert harness.count(flat, aten.permute.default) == 1  # the weight, still transposed inside
    assert not any(n.target in VIEWS for n in flat.graph.nodes if n.op == "call_function")
    placeholders = [p.meta["val"] for p in flat.graph.find_nodes(op="placeholder")]
    assert [tuple(v.shape) for v in placeholders] == [rows_form(a.shape) for a in args]


def test_region_already_2d_is_left_alone(harness):
    assert flatten_gemm_region(harness.trace(linear_gelu, *_linear_gelu_args())) is None


def test_views_that_move_the_last_dim_are_left_alone(harness):
    def heads(x, w):
        return torch.relu((x @ w).reshape(4, 2, 8))

    assert flatten_gemm_region(harness.trace(heads, torch.randn(4, 8), torch.randn(8, 16))) is None


def test_permute_of_the_3d_view_is_left_alone_quietly(harness, caplog):
    """A permute of the linear's 3-D view (Whisper's heads) has no 2-D form: kept as it was,
    without a fake-tensor op failing on a 2-D input (which logs its traceback as an error)."""

    def transposed(x, w):
        return torch.relu((x @ w).reshape(2, 4, 16).permute(0, 2, 1))

    with caplog.at_level(logging.ERROR):
        gm = harness.trace(transposed, torch.randn(8, 8), torch.randn(8, 16))
        assert flatten_gemm_region(gm) is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("bias_shape", [(2, 1, 16), (1, 4, 16)], ids=["per-batch", "per-token"])
def test_broadcast_over_a_leading_dim_is_left_alone_quietly(harness, caplog, bias_shape):
    """A bias that broadcasts over a leading dim (per batch ``[2, 1, N]``; per token
    ``[1, L, N]`` like ViT's position embeddings) does not broadcast in the 2-D form: kept as it
    was, found from the sizes, without a fake-tensor op failing (which logs its traceback as an
    error in the user's compile)."""

    def biased(x, w, bias):
        return torch.relu((x @ w).reshape(2, 4, 16) + bias)

    args = (torch.randn(8, 8), torch.randn(8, 16), torch.randn(bias_shape))
    with caplog.at_level(logging.ERROR):
        assert flatten_gemm_region(harness.trace(biased, *args)) is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@BERT_REGIONS
def test_2d_form_takes_the_blocked_gemm_and_equals_eager(harness, fn, make):
    torch.manual_seed(0)
    args = make()
    ir = import_region(flatten_gemm_region(harness.trace(fn, *args)))
    lowered = str(lower_to_llvm(ir, "vector"))  # raises where the GEMM strategy refuses
    assert "vector<16xf32>" in lowered and "contract" in lowered
    region = CompiledRegion(ir, "vector")
    expected = fn(*args)
    out = torch.empty(expected.shape)  # the graph's shape; the kernel writes its 2-D form
    region(list(args), [out])
    torch.testing.assert_close(out, fn(*(a.double() for a in args)).float(), atol=2e-5, rtol=2e-5)


def test_signature_shapes_read_from_the_ir(harness):
    ir = import_region(harness.trace(linear_gelu, *_linear_gelu_args()))
    assert signature_shapes(ir) == [(16, 40), (48, 40), (48,), (16, 48)]
    dynamic = ir.replace("!torch.vtensor<[16,40],f32>", "!torch.vtensor<[?,40],f32>")
    assert signature_shapes(dynamic) is None


def test_kernel_refuses_a_tensor_of_another_size(harness):
    args = _linear_gelu_args()
    region = CompiledRegion(import_region(harness.trace(linear_gelu, *args)), "vector")
    with pytest.raises(ValueError, match="the kernel takes"):
        region([torch.randn(8, 40), *args[1:]], [torch.empty(16, 48)])


@pytest.fixture
def forced(monkeypatch, tmp_path):
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")


@pytest.mark.parametrize(
    ("fn", "make"),
    [
        (linear_gelu, _linear_gelu_args),
        (bert_output, _bert_output_args),
        (bert_intermediate, _bert_intermediate_args),
    ],
    ids=["linear_gelu", "output_residual", "intermediate_gelu"],
)
def test_outlined_gemm_region_reads_the_weight_and_equals_eager(harness, forced, fn, make):
    torch.manual_seed(0)
    args = make()
    gm = harness.trace(fn, *args)
    outlined = auto_fuse(gm.graph, MFusionConfig(backend="mlir-cpu"), GraphReport(0, "mlir-cpu"))
    gm.recompile()
    assert outlined == 1
    (call,) = [n for n in gm.graph.nodes if n.target is REGION_OP]
    inputs, ir, pipeline = call.args[0], call.args[1], call.args[3]
    assert pipeline == "vector"
    assert "torch.aten.permute" in ir  # the weight is packed inside, not copied per call
    assert all(i.op == "placeholder" for i in inputs if i.meta["val"].dim() == 2)
    assert harness.count(gm, aten.permute.default) == 0
    torch.testing.assert_close(gm(*args), fn(*args), atol=1e-4, rtol=1e-4)
