"""Transpose absorption: drop ``.contiguous()`` copies of transposed matmul operands.

GEMM kernels take a transposed operand through its strides (BLAS ``trans`` flags), so
``mm(a, w.t().contiguous())`` copies the whole weight for nothing.

Universal (no machine check): one copy of the operand fewer, the same GEMM; strictly fewer passes
over memory on any machine.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, int_list, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Rewrite

MATMULS = (aten.mm.default, aten.bmm.default, aten.addmm.default)


def _transpose_copy(node: object) -> fx.Node | None:
    """The transposed view under ``clone(transpose(x))`` when only the last two dims swap."""
    if not is_op(node, aten.clone.default) or len(node.users) != 1:
        return None
    view = node.args[0]
    value = tensor_val(view)
    if value is None:
        return None
    if is_op(view, aten.t.default):
        return view
    if is_op(view, aten.permute.default):
        dims = int_list(view.args[1])
        if dims is None:
            return None
        order = [d % value.dim() for d in dims]
        expected = [*list(range(value.dim() - 2)), value.dim() - 1, value.dim() - 2]
        return view if order == expected else None
    if is_op(view, aten.transpose.int):
        swapped = int_list(view.args[1:3])
        if swapped is None:
            return None
        pair = sorted(d % value.dim() for d in swapped)
        return view if pair == [value.dim() - 2, value.dim() - 1] else None
    return None


class MatMulTransposePass(MFusionPass):
    """Anchor on a matmul; replace contiguous copies of transposed operands by the views."""

    name = "matmul_transpose"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, *MATMULS):
            return None
        first = 1 if node.target is aten.addmm.default else 0
        operands = list(node.args)
        swapped = 0
        for i in (first, first + 1):
            view = _transpose_copy(operands[i])
            if view is not None:
                operands[i] = view
                swapped += 1
        if not swapped:
            return None

        def rewrite() -> str:
            replace(node, emit(node.graph, node.target, *operands, **node.kwargs))
            return f"{swapped} transposed operand copy(ies) removed from {node.target}"

        return rewrite
