"""Matmul with inner dimension K=1 into a broadcast multiply (an outer product, no GEMM call).

Universal (no machine check): the same M*N products written once, without a GEMM call, and as an
elementwise op Inductor can fuse with its neighbours: never more work or memory traffic.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import FLOAT_DTYPES, aten, emit, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


class K1MatMulPass(MFusionPass):
    """Anchor on ``mm``/``bmm`` whose contraction dim is statically 1."""

    name = "k1_matmul"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.mm.default, aten.bmm.default):
            return None
        va, vb = (tensor_val(a) for a in node.args[:2])
        if va is None or vb is None:
            return None
        k = va.shape[-1]
        if not isinstance(k, int) or k != 1:
            return None
        if va.dtype not in FLOAT_DTYPES:
            raise Refusal(f"dtype {va.dtype}: integer matmul has no broadcast-multiply twin here")

        def rewrite() -> str:
            # [.., M, 1] * [.., 1, N] broadcasts to [.., M, N]: each output is the single product.
            replace(node, emit(node.graph, aten.mul.Tensor, *node.args[:2]))
            return f"{node.target} with K=1 as a broadcast multiply"

        return rewrite
