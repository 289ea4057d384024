"""Add + RMSNorm: a residual add whose sum is both kept and RMS-normalised.

Both outputs (the new residual and the normalised tensor) come from one canonical region, so
Inductor reads the two addends once and writes the sum and the norm from one kernel.

Universal (no machine check): the sum is not written and read back by a second kernel, so it
never makes more passes over memory on any machine.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, cast_target, dtype_of, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite
from mfusion.passes.rmsnorm import emit_rmsnorm, match_rmsnorm


def _residual_add(x: fx.Node) -> fx.Node | None:
    """The tensor-tensor add that produced ``x``, looking through an up-cast."""
    if is_op(x, aten.add.Tensor) and all(isinstance(a, fx.Node) for a in x.args[:2]):
        return x
    if cast_target(x) is not None and is_op(x.args[0], aten.add.Tensor):
        return x.args[0]
    return None


class AddRMSNormPass(MFusionPass):
    """Recognise ``h = a + b; y = rmsnorm(h)`` with ``h`` also used elsewhere, and canonicalise."""

    name = "add_rmsnorm"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        found = match_rmsnorm(node)
        if found is None:
            return None
        add = _residual_add(found.x)
        if add is None:
            return None
        a, b = add.args[:2]
        va, vb = tensor_val(a), tensor_val(b)
        if va is None or vb is None or va.shape != vb.shape:
            raise Refusal("residual addends differ in shape: the add broadcasts, not a residual")
        if va.dtype != vb.dtype:
            raise Refusal(f"residual addends differ in dtype ({va.dtype} vs {vb.dtype})")

        def rewrite() -> str:
            replace(found.out, emit_rmsnorm(node.graph, found.x, found.eps))
            kept = "kept" if len(add.users) > 1 else "not kept"
            return f"residual add + RMSNorm (sum {kept}, eps={found.eps:g}, {dtype_of(found.x)})"

        return rewrite
