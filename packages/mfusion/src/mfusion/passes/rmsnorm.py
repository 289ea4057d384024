"""RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps)`` (or ``x / sqrt(...)``) into its canonical form.

The canonical form squares with a multiply, scales by ``rsqrt`` (no division) and keeps the
original compute dtype, so Inductor emits one reduction kernel with the cheapest epilogue.

Universal (no machine check): the same single loop with a multiply for ``pow`` and ``rsqrt`` for a
square root and a division: fewer operations per element, same passes over memory, on any machine.
"""

from __future__ import annotations

import dataclasses

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
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


@dataclasses.dataclass(frozen=True)
class RMSNormMatch:
    """A verified RMSNorm: the normalised input, its epsilon and the node producing the result."""

    x: fx.Node
    eps: float
    out: fx.Node


def match_rmsnorm(node: fx.Node) -> RMSNormMatch | None:
    """Match an RMSNorm ending at ``node``; raise Refusal when it is close but not RMSNorm."""
    if is_op(node, aten.mul.Tensor):
        for x, scale in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if is_op(scale, aten.rsqrt.default) and isinstance(x, fx.Node):
                return _check(node, x, scale.args[0])
    if is_op(node, aten.div.Tensor) and is_op(node.args[1], aten.sqrt.default):
        return _check(node, node.args[0], node.args[1].args[0])
    return None


def _check(out: fx.Node, x: object, denom: object) -> RMSNormMatch | None:
    mean: fx.Node | None
    eps: object
    if is_op(denom, aten.mean.dim):
        mean, eps = denom, None
    elif is_op(denom, aten.add.Tensor) and denom.kwargs.get("alpha", 1) == 1:
        mean = next((a for a in denom.args if is_op(a, aten.mean.dim)), None)
        if mean is None:
            return None
        eps = other_operand(denom, mean)
    else:
        return None
    squared = mean.args[0]
    if is_op(squared, aten.pow.Tensor_Scalar):
        base, exponent = squared.args
        if exponent != 2:
            raise Refusal(f"pow exponent {exponent} is not 2: not a root-mean-square")
    elif is_op(squared, aten.mul.Tensor) and squared.args[0] is squared.args[1]:
        base = squared.args[0]
    else:
        return None
    if base is not x or not isinstance(x, fx.Node):  # base is a node: so is x when they agree
        raise Refusal(f"normalises {base} but scales {x}: not one RMSNorm")
    ndim = ndim_of(x)
    dims = mean.args[1] if len(mean.args) > 1 else None
    if not is_last_dim_reduction(dims, ndim):
        raise Refusal(f"mean over dims {dims} of a {ndim}-d tensor; RMSNorm reduces the last dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not keepdim:
        raise Refusal("mean without keepdim: the statistic does not broadcast over the row")
    if eps is None:
        raise Refusal("eps missing: rsqrt(mean(x^2)) is infinite for an all-zero row")
    if not is_float_scalar(eps) or not 0 < float(eps) < 1e-1:
        raise Refusal(f"eps {eps} is not a small positive constant")
    if dtype_of(x) not in FLOAT_DTYPES:
        raise Refusal(f"dtype {dtype_of(x)} is not a floating dtype")
    return RMSNormMatch(x, float(eps), out)


def emit_rmsnorm(graph: fx.Graph, x: fx.Node, eps: float) -> fx.Node:
    """Canonical RMSNorm of ``x`` over its last dim, in x's dtype."""
    mean = emit(graph, aten.mean.dim, emit(graph, aten.mul.Tensor, x, x), [-1], True)
    return emit(
        graph,
        aten.mul.Tensor,
        x,
        emit(graph, aten.rsqrt.default, emit(graph, aten.add.Tensor, mean, eps)),
    )


class RMSNormPass(MFusionPass):
    """Canonicalise RMSNorm (the weight multiply that follows is left for Inductor to fuse)."""

    name = "rmsnorm"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        found = match_rmsnorm(node)
        if found is None:
            return None

        def rewrite() -> str:
            replace(found.out, emit_rmsnorm(node.graph, found.x, found.eps))
            return f"RMSNorm over the last dim (eps={found.eps:g}, {dtype_of(found.x)})"

        return rewrite
