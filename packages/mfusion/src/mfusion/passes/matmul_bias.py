"""Bias absorption: ``mm(a, b) + bias`` into ``addmm(bias, a, b)`` (one GEMM call with beta=1).

Not a speed bet of ours: ``addmm`` is what ``nn.Linear`` itself lowers to, so the rewrite gives a
hand-written linear the form Inductor already handles for that device. Where Inductor prefers the
opposite (on GPUs it splits ``addmm`` feeding pointwise ops into ``mm`` + an add fused into the
pointwise kernel, ``should_prefer_unfused_addmm``), the pass leaves the match alone:
:func:`inductor_prefers_unfused`.
"""

from __future__ import annotations

import torch
from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, is_op, other_operand, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def inductor_prefers_unfused(device: torch.device, total: fx.Node) -> bool:
    """True when Inductor would split an ``addmm`` producing ``total`` back into mm + add: on a
    GPU, when a user of the sum is pointwise (the add then fuses into that kernel's loads)."""
    if device.type == "cpu":
        return False
    return any(
        user.op == "call_function" and torch.Tag.pointwise in getattr(user.target, "tags", ())
        for user in total.users
    )


def bias_refusal(bias: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why ``bias`` cannot be the addmm input for a product ``out`` [M, N]; None if it can."""
    if bias.dtype != out.dtype:
        return f"bias dtype {bias.dtype} differs from the product's {out.dtype}"
    if bias.dim() > 2:
        return f"bias has {bias.dim()} dims; addmm takes at most [M, N]"
    try:
        # torch.broadcast_shapes is not annotated in torch
        shape = torch.broadcast_shapes(tuple(bias.shape), tuple(out.shape))  # type: ignore[no-untyped-call]
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
        if inductor_prefers_unfused(vo.device, node):
            raise Refusal(
                f"on {vo.device.type} Inductor fuses the bias add into the pointwise user instead"
            )

        def rewrite() -> str:
            replace(node, emit(node.graph, aten.addmm.default, bias, *mm.args[:2]))
            return f"mm + bias {tuple(vb.shape)} as addmm"

        return rewrite
