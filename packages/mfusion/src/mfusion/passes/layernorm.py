"""LayerNorm written by hand (``(x - mean) / sqrt(var + eps)``) into one Welford reduction.

Hand-written LayerNorm reduces twice (the mean, then the mean of squared deviations).
``var_mean`` computes both statistics in one pass over the row, which Inductor lowers to a
single Welford reduction; the normalisation multiplies by ``rsqrt`` instead of dividing.

Universal (no machine check): one pass over each row instead of two, on any machine.
"""

from __future__ import annotations

import operator

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import (
    FLOAT_DTYPES,
    aten,
    dtype_of,
    emit,
    is_float_scalar,
    is_last_dim_reduction,
    is_op,
    ndim_of,
    other_operand,
    replace,
    square_base,
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def _centered(node: object) -> tuple[fx.Node, fx.Node] | None:
    """``(x, mean)`` for ``sub(x, mean(x, [-1], keepdim=True))``."""
    if not is_op(node, aten.sub.Tensor):
        return None
    x, mean = node.args[:2]
    if isinstance(x, fx.Node) and is_op(mean, aten.mean.dim) and mean.args[0] is x:
        return x, mean
    return None


def _keepdim(node: fx.Node, index: int) -> bool:
    return bool(node.args[index] if len(node.args) > index else node.kwargs.get("keepdim", False))


def _variance(var: object, x: fx.Node) -> bool | None:
    """True if ``var`` is the biased variance of ``x`` over the last dim; Refusal if it is close."""
    ndim = ndim_of(x)
    if is_op(var, aten.var.correction):
        if var.args[0] is not x:
            return None
        dims = var.args[1] if len(var.args) > 1 else var.kwargs.get("dim")
        correction = var.kwargs.get("correction", 1)
        if correction != 0:
            raise Refusal(f"variance with correction={correction}; LayerNorm uses the biased one")
        keepdim = var.kwargs.get("keepdim", False)
    elif is_op(var, aten.mean.dim):
        inner = var.args[0]
        if is_op(inner, aten.pow.Tensor_Scalar) and inner.args[1] != 2:
            raise Refusal(f"pow exponent {inner.args[1]} is not 2: not a variance")
        centered = _centered(square_base(inner))
        if centered is None or centered[0] is not x:
            return None
        dims, keepdim = var.args[1], _keepdim(var, 2)
    else:
        return None
    if not is_last_dim_reduction(dims, ndim):
        raise Refusal(f"variance over dims {dims} of a {ndim}-d tensor; LayerNorm uses the last")
    if not keepdim:
        raise Refusal("variance without keepdim does not broadcast over the row")
    return True


class LayerNormPass(MFusionPass):
    """Rewrite hand-written LayerNorm statistics into one ``var_mean`` (affine part left as is)."""

    name = "layernorm"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        centered: object
        denom: object
        if is_op(node, aten.div.Tensor) and is_op(node.args[1], aten.sqrt.default):
            centered, denom = node.args[0], node.args[1].args[0]
        elif is_op(node, aten.mul.Tensor):
            rsqrt = next((a for a in node.args[:2] if is_op(a, aten.rsqrt.default)), None)
            if rsqrt is None:
                return None
            centered, denom = other_operand(node, rsqrt), rsqrt.args[0]
        else:
            return None
        found = _centered(centered)
        scale = None
        if found is None and is_op(centered, aten.mul.Tensor):
            # BERT_pytorch writes ``a * (x - mean) / sqrt(var + eps)``: the weight rides along.
            inner = next((a for a in centered.args[:2] if _centered(a) is not None), None)
            if inner is not None and len(centered.users) == 1:
                scale, found = other_operand(centered, inner), _centered(inner)
        if found is None:
            return None
        x, mean = found
        if not is_last_dim_reduction(mean.args[1], ndim_of(x)) or not _keepdim(mean, 2):
            raise Refusal(f"mean over dims {mean.args[1]} with keepdim; LayerNorm needs the last")
        var: object
        eps: object
        if is_op(denom, aten.add.Tensor) and denom.kwargs.get("alpha", 1) == 1:
            var = next((a for a in denom.args[:2] if isinstance(a, fx.Node)), None)
            eps = other_operand(denom, var)
        else:
            var, eps = denom, None
        if not _variance(var, x):
            return None
        if eps is None:
            raise Refusal("eps missing: a constant row divides by zero")
        if not is_float_scalar(eps) or not 0 < float(eps) < 1e-1:
            raise Refusal(f"eps {eps} is not a small positive constant")
        eps_value = float(eps)
        if dtype_of(x) not in FLOAT_DTYPES:
            raise Refusal(f"dtype {dtype_of(x)} is not a floating dtype")

        def rewrite() -> str:
            graph = node.graph
            stats = emit(graph, aten.var_mean.correction, x, [-1], correction=0, keepdim=True)
            var_node = emit(graph, operator.getitem, stats, 0)
            mean_node = emit(graph, operator.getitem, stats, 1)
            inv = emit(graph, aten.rsqrt.default, emit(graph, aten.add.Tensor, var_node, eps))
            normed = emit(graph, aten.mul.Tensor, emit(graph, aten.sub.Tensor, x, mean_node), inv)
            if scale is not None:
                normed = emit(graph, aten.mul.Tensor, normed, scale)
            replace(node, normed)
            return f"LayerNorm statistics as one var_mean (eps={eps_value:g}, {dtype_of(x)})"

        return rewrite
