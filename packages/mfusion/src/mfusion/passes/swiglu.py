"""SwiGLU: ``silu(gate) * up`` with SiLU in any spelling, into ``gate * sigmoid(gate) * up``.

Accepted SiLU spellings: ``gate * sigmoid(gate)`` and ``gate / (1 + exp(-gate))``. The canonical
form has no division and no exp of a negation; Inductor fuses it into one pointwise kernel.

Universal (no machine check): fewer operations in the same single loop, on any machine.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import (
    FLOAT_DTYPES,
    as_node,
    aten,
    emit,
    is_float_scalar,
    is_op,
    other_operand,
    replace,
    tensor_val,
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def silu_input(node: object) -> fx.Node | None:
    """``a`` if ``node`` computes silu(a) in one of the accepted spellings."""
    if is_op(node, aten.mul.Tensor):
        sig = next((s for s in node.args[:2] if is_op(s, aten.sigmoid.default)), None)
        if sig is not None and other_operand(node, sig) is sig.args[0]:
            return as_node(sig.args[0])
    if is_op(node, aten.div.Tensor):
        a, denom = node.args[:2]
        if is_op(denom, aten.add.Tensor):
            # the other operand of `1 + exp(-a)`; the one may be traced as 1 or 1.0
            left, right = denom.args[:2]
            exp = right if _is_one(left) else left if _is_one(right) else None
            neg = exp.args[0] if is_op(exp, aten.exp.default) else None
            if is_op(neg, aten.neg.default) and neg.args[0] is a:
                return as_node(a)
    return None


def _is_one(value: object) -> bool:
    return is_float_scalar(value) and value == 1


def _producer(node: fx.Node) -> str:
    if is_op(node, aten.mm.default, aten.addmm.default, aten.bmm.default):
        return str(node.target).split(".")[1]
    return node.op


def _gate_and_up(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(gate, up)`` of ``mul(silu(gate), up)`` with the operands in either order."""
    for act, up in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        gate = silu_input(act) if isinstance(up, fx.Node) else None
        if gate is not None and isinstance(up, fx.Node) and gate is not up:
            return gate, up
    return None


class SwiGLUPass(MFusionPass):
    """Anchor on ``mul(silu(gate), up)``; gate and up must agree in shape and dtype."""

    name = "swiglu"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.mul.Tensor):
            return None
        match = _gate_and_up(node)
        if match is None:
            return None
        gate, up = match
        vg, vu = tensor_val(gate), tensor_val(up)
        if vg is None or vu is None:
            return None
        if vg.shape != vu.shape:
            raise Refusal(
                f"gate {tuple(vg.shape)} and up {tuple(vu.shape)} differ: broadcast, not GLU"
            )
        if vg.dtype != vu.dtype or vg.dtype not in FLOAT_DTYPES:
            raise Refusal(f"gate/up dtypes {vg.dtype}/{vu.dtype}: need one floating dtype")

        def rewrite() -> str:
            graph = node.graph
            silu = emit(graph, aten.mul.Tensor, gate, emit(graph, aten.sigmoid.default, gate))
            replace(node, emit(graph, aten.mul.Tensor, silu, up))
            return f"SwiGLU (gate from {_producer(gate)}, up from {_producer(up)}, {vg.dtype})"

        return rewrite
