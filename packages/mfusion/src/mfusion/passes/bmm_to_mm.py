"""BMM with batch 1 into MM: the 2-D GEMM path skips batched-GEMM set-up and strides.

Universal (no machine check): the same single GEMM on the same data; only views are added.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


class BMMToMMPass(MFusionPass):
    """Anchor on ``bmm`` whose (static) batch is 1."""

    name = "bmm_to_mm"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.bmm.default):
            return None
        va, vb = (tensor_val(a) for a in node.args[:2])
        if va is None or vb is None:
            return None
        batch = va.shape[0]
        if not isinstance(batch, int):
            raise Refusal(f"batch {batch} is symbolic: cannot prove it is 1")
        if batch != 1:
            return None
        if not all(isinstance(s, int) for s in (*va.shape, *vb.shape)):
            raise Refusal("M, K or N is symbolic: the 2-D views need static sizes")

        def rewrite() -> str:
            graph = node.graph
            a = emit(graph, aten.reshape.default, node.args[0], list(va.shape[1:]))
            b = emit(graph, aten.reshape.default, node.args[1], list(vb.shape[1:]))
            out = emit(graph, aten.mm.default, a, b)
            replace(node, emit(graph, aten.unsqueeze.default, out, 0))
            return (
                f"bmm [1, {va.shape[1]}, {va.shape[2]}] x [1, {vb.shape[1]}, {vb.shape[2]}] as mm"
            )

        return rewrite
