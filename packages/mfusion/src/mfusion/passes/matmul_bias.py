"""Bias absorption: ``mm(a, b) + bias`` into ``addmm(bias, a, b)`` (one GEMM call with beta=1)."""

from __future__ import annotations

import torch
from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, is_op, other_operand, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def bias_refusal(bias: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why ``bias`` cannot be the addmm input for a product ``out`` [M, N]; None if it can."""
    if bias.dtype != out.dtype:
        return f"bias dtype {bias.dtype} differs from the product's {out.dtype}"
    if bias.dim() > 2:
        return f"bias has {bias.dim()} dims; addmm takes at most [M, N]"
    try:
        shape = torch.broadcast_shapes(tuple(bias.shape), tuple(out.shape))
    except RuntimeError:
        return f"bias {tuple(bias.shape)} does not broadcast to {tuple(out.shape)}"
    if tuple(shape) != tuple(out.shape):
        return f"bias {tuple(bias.shape)} would enlarge the product {tuple(out.shape)}"
    return None


class MatMulBiasPass(MFusionPass):
    """Anchor on ``add(mm, bias)`` where the product has no other user."""

    name = "matmul_bias"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:
            return None
        mm = next((a for a in node.args[:2] if is_op(a, aten.mm.default)), None)
        if mm is None:
            return None
        bias = other_operand(node, mm)
        vb, vo = tensor_val(bias), tensor_val(mm)
        if vb is None or vo is None:
            return None
        reason = bias_refusal(vb, vo)
        if reason:
            raise Refusal(reason)
        if len(mm.users) != 1:
            raise Refusal("the bare product is also used elsewhere")

        def rewrite() -> str:
            replace(node, emit(node.graph, aten.addmm.default, bias, *mm.args[:2]))
            return f"mm + bias {tuple(vb.shape)} as addmm"

        return rewrite
