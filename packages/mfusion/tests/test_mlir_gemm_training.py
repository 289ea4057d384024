"""GEMM regions of a training step: the forward's two-output region (pre-activation saved for
the backward and its GELU), a weight gradient ``g^T x`` (transposed left operand), a bare
``mm``, and backward GEMMs whose epilogue is the GELU backward or writes several gradient
pieces. Each must lower with the blocked GEMM strategy (not the scalar fallback) and equal
eager at shapes that are and are not multiples of the blocks; a compiled training step with the
regions forced equals eager in its loss and every gradient. Decisions are forced or the kernels
called directly: no outcome depends on the speed of the machine."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import mfusion
from mfusion.autofuse.capability import MLIR_CPU_TABLE
from mfusion.autofuse.cluster import grow_regions
from mfusion.autofuse.fuse import candidate_kinds
from mfusion.mlir.gemm import fold_left_transpose, merge_epilogue
from mfusion.mlir.importer import import_region
from mfusion.mlir.pipeline import lower_to_llvm
from mfusion.mlir.runtime import CompiledRegion

aten = torch.ops.aten
SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327


def linear_gelu_two_outputs(x, w, b):
    """The forward of a training step: the pre-activation is saved for the backward."""
    y = torch.addmm(b, x, w.permute(1, 0))
    return y, 0.5 * y * (1 + torch.erf(y * SQRT_HALF))


def weight_grad(g, x):
    """``dW = g^T x``: the left operand transposed, K = tokens."""
    return (torch.mm(g.permute(1, 0), x),)


def bare_mm(a, b):
    return (torch.mm(a, b),)


def grad_gelu_backward(d, w, pre):
    """``dpre = (d @ W) * gelu'(pre)``: the GELU backward as the epilogue of the GEMM that
    produces the gradient of the activation."""
    dh = torch.mm(d, w)
    cdf = 0.5 * (1 + torch.erf(pre * SQRT_HALF))
    return (dh * (cdf + pre * torch.exp(pre * pre * -0.5) * INV_SQRT_2PI),)


def grad_residual_norm(g, w, residual, gamma, xhat):
    """A backward GEMM whose epilogue writes several pieces (residual gradient, LayerNorm
    backward products), as BERT's backward graph has it."""
    a = residual + torch.mm(g, w)
    b = a * gamma
    return a, b, b * 256.0, b * xhat, a * xhat


def _args(name: str, m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    scale = k**-0.5
    if name == "linear_gelu_two_outputs":
        return torch.randn(m, k), torch.randn(n, k) * scale, torch.randn(n)
    if name == "weight_grad":
        return torch.randn(k, m), torch.randn(k, n) * scale
    if name == "bare_mm":
        return torch.randn(m, k), torch.randn(k, n) * scale
    if name == "grad_gelu_backward":
        return torch.randn(m, k), torch.randn(k, n) * scale, torch.randn(m, n)
    return (
        torch.randn(m, k),
        torch.randn(k, n) * scale,
        torch.randn(m, n),
        torch.randn(n),
        torch.randn(m, n),
    )


FORMS = {
    "linear_gelu_two_outputs": linear_gelu_two_outputs,
    "weight_grad": weight_grad,
    "bare_mm": bare_mm,
    "grad_gelu_backward": grad_gelu_backward,
    "grad_residual_norm": grad_residual_norm,
}
# (M, K, N): blocks divide; ragged M and N (peeled 4-row block, narrow panels); M below a block
SHAPES = [(16, 24, 32), (13, 20, 29), (37, 64, 48), (3, 8, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(FORMS))
def test_training_gemm_form_matches_eager(harness, name, shape):
    fn = FORMS[name]
    torch.manual_seed(0)
    args = _args(name, *shape)
    region = CompiledRegion(import_region(harness.trace(fn, *args)), "vector")
    expected = fn(*(a.double() for a in args))
    outs = [torch.empty(e.shape) for e in expected]
    region(list(args), outs)
    for out, ref, eager in zip(outs, expected, fn(*args), strict=True):
        torch.testing.assert_close(out, ref.float(), atol=5e-5, rtol=2e-5)
        torch.testing.assert_close(out, eager, atol=2e-4, rtol=1e-4)


def _linalg(harness, fn, args):
    """The region in linalg on tensors, element-wise ops fused, as the GEMM lowering gets it."""
    from torch_mlir import ir
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d

    context = ir.Context()
    torch_d.register_dialect(context)
    module = ir.Module.parse(import_region(harness.trace(fn, *args)), context)
    run_pipeline_with_repro_report(
        module,
        "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline,"
        "func.func(linalg-fuse-elementwise-ops),func.func(canonicalize))",
        "to linalg",
    )
    return module


@contextlib.contextmanager
def _at(module):
    """The module's context with an unknown location, as the lowering runs its rewrites."""
    from torch_mlir import ir

    with module.context, ir.Location.unknown():
        yield


def _ops(module, name: str) -> list:
    return [
        op for op in module.body.operations[0].regions[0].blocks[0].operations if op.name == name
    ]


def test_left_transpose_is_read_through_the_matmul_map(harness):
    module = _linalg(harness, weight_grad, _args("weight_grad", 16, 24, 32))
    with _at(module):
        (matmul,) = _ops(module, "linalg.matmul")
        assert _ops(module, "linalg.transpose")  # torch-mlir's form: a transpose, then a matmul
        folded = fold_left_transpose(matmul.operation)
        assert not _ops(module, "linalg.transpose")
        assert folded.operands[0].type == module.body.operations[0].arguments[0].type
        assert module.operation.verify()


@pytest.mark.parametrize(
    ("name", "outputs"), [("linear_gelu_two_outputs", 2), ("grad_residual_norm", 5)]
)
def test_epilogues_merge_into_one_generic_per_region(harness, name, outputs):
    module = _linalg(harness, FORMS[name], _args(name, 16, 24, 32))
    with _at(module):
        assert len(_ops(module, "linalg.generic")) > 1  # one per returned value, before
        (matmul,) = _ops(module, "linalg.matmul")
        merged = merge_epilogue(module, matmul.operation)
        (generic,) = _ops(module, "linalg.generic")
        assert generic.operation == merged and len(merged.results) == outputs
        assert module.operation.verify()


def test_an_epilogue_reading_an_intermediate_through_a_broadcast_is_refused(harness):
    """A reduction or broadcast of an intermediate cannot be computed from one accumulator
    tile: the region is refused (and falls back to the scalar pipeline)."""

    def row_scaled(x, w):
        y = torch.mm(x, w)
        return (y * y[:, :1],)

    module = _linalg(harness, row_scaled, (torch.randn(8, 16), torch.randn(16, 32)))
    with _at(module):
        (matmul,) = _ops(module, "linalg.matmul")
        with pytest.raises(ValueError, match="outside the epilogue"):
            merge_epilogue(module, matmul.operation)


@pytest.mark.parametrize("name", ["weight_grad", "linear_gelu_two_outputs", "grad_residual_norm"])
def test_training_forms_take_the_blocked_gemm(harness, name):
    fn = FORMS[name]
    ir = import_region(harness.trace(fn, *_args(name, 16, 24, 32)))
    lowered = str(lower_to_llvm(ir, "vector"))  # raises where the GEMM strategy refuses
    assert "vector<16xf32>" in lowered and "contract" in lowered
    assert "memrefCopy" not in lowered


def test_left_permute_joins_the_matmul_region(harness):
    gm = harness.trace(
        lambda g, x: torch.relu(g.permute(1, 0) @ x), torch.randn(8, 4), torch.randn(8, 16)
    )
    kinds = candidate_kinds(gm.graph, MLIR_CPU_TABLE)
    (region,) = grow_regions(gm.graph, kinds, max_ops=16)
    assert {aten.permute.default, aten.mm.default} <= {n.target for n in region.nodes}


def test_views_read_only_after_the_region_stay_out(harness):
    """The gradient's transposed view for the weight gradient is not a region output: it stays
    a view of the output outside the region."""

    def backward_piece(d, w, pre):
        (dpre,) = grad_gelu_backward(d, w, pre)
        return dpre, dpre.permute(1, 0)

    gm = harness.trace(backward_piece, torch.randn(8, 16), torch.randn(16, 32), torch.randn(8, 32))
    kinds = candidate_kinds(gm.graph, MLIR_CPU_TABLE)
    regions = [
        r
        for r in grow_regions(gm.graph, kinds, max_ops=32)
        if aten.mm.default in {n.target for n in r.nodes}
    ]
    (region,) = regions
    assert aten.permute.default not in {n.target for n in region.nodes}


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.down(nn.functional.gelu(self.up(x)))).square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [16, 13])
def test_training_step_with_forced_regions_equals_eager(harness, monkeypatch, tmp_path, tokens):
    monkeypatch.setenv("MFUSION_CACHE_DIR", str(tmp_path / "mfusion"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("MFUSION_MLIR_CHOICE", "always")
    torch.manual_seed(0)
    model = _Mlp(24, 40)
    x = torch.randn(2, tokens, 24)
    reference = _Mlp(24, 40)
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    mfusion.clear_report()
    harness.step_equals_eager(model, reference, x, backend="mlir-cpu")
    outlined = [r for g in mfusion.report().graphs for r in g.regions if r.outlined]
    assert any(r.kind == "matmul" for r in outlined)
    torch._dynamo.reset()
