"""Cast absorption: ``mm(a.float(), b.float()).to(bf16)`` runs as a bf16 matmul.

CPU and GPU bf16/fp16 GEMMs accumulate in fp32 and round once, exactly what the up-cast chain
spells out; absorbing the casts avoids materialising two fp32 copies of the operands.
"""

from __future__ import annotations

import torch
from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import LOW_PRECISION, aten, cast_target, dtype_of, emit, is_op, replace
from mfusion.passes.base import MFusionPass, Refusal, Rewrite

MATMULS = (aten.mm.default, aten.bmm.default)


class MatMulCastPass(MFusionPass):
    """Anchor on the down-cast of an up-cast matmul."""

    name = "matmul_cast"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        target = cast_target(node)
        if target is None or not is_op(node.args[0], *MATMULS):
            return None
        mm = node.args[0]
        ups = mm.args[:2]
        if not all(cast_target(u) == torch.float32 for u in ups):
            return None
        sources = [dtype_of(u.args[0]) for u in ups]
        if target not in LOW_PRECISION or sources != [target, target]:
            raise Refusal(f"casts {sources} -> fp32 -> {target}: not a round trip of one dtype")
        if len(mm.users) != 1:
            raise Refusal("the fp32 product is also used elsewhere; absorbing would change it")
        if not config.absorb_matmul_casts:
            raise Refusal("disabled by absorb_matmul_casts=False")

        def rewrite() -> str:
            replace(node, emit(node.graph, mm.target, ups[0].args[0], ups[1].args[0]))
            return f"{mm.target} in {target} without fp32 operand copies"

        return rewrite
