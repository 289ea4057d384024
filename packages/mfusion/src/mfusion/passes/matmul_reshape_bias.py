"""MatMul-Reshape-Bias reorder: ``reshape(mm(a, w), [B, S, N]) + bias`` into
``reshape(addmm(bias, a, w), [B, S, N])`` so the bias rides in the GEMM call.

Like ``matmul_bias`` (whose device rule it shares, :func:`inductor_prefers_unfused`), this
produces the ``addmm`` form ``nn.Linear`` lowers to; it is not tuned to one CPU.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, is_op, other_operand, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite
from mfusion.passes.matmul_bias import bias_refusal, inductor_prefers_unfused

RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


class MatMulReshapeBiasPass(MFusionPass):
    """Anchor on ``add(reshape(mm), bias)`` where the reshape keeps the last dim N."""

    name = "matmul_reshape_bias"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:
            return None
        view = next((a for a in node.args[:2] if is_op(a, *RESHAPES)), None)
        if view is None or not is_op(view.args[0], aten.mm.default):
            return None
        mm = view.args[0]
        bias = other_operand(node, view)
        vb, vm, vv = tensor_val(bias), tensor_val(mm), tensor_val(view)
        if vb is None or vm is None or vv is None:
            return None
        if vv.shape[-1] != vm.shape[-1]:
            raise Refusal(f"reshape {tuple(vm.shape)} -> {tuple(vv.shape)} changes the last dim")
        if vb.dim() > 1 and any(s != 1 for s in vb.shape[:-1]):
            raise Refusal(f"bias {tuple(vb.shape)} varies along reshaped dims")
        reason = bias_refusal(vb.reshape(vb.shape[-1:]) if vb.dim() else vb, vm)
        if reason:
            raise Refusal(reason)
        if len(mm.users) != 1 or len(view.users) != 1:
            raise Refusal("the product or its reshape is also used elsewhere")
        if inductor_prefers_unfused(vm.device, node):
            raise Refusal(
                f"on {vm.device.type} Inductor fuses the bias add into the pointwise user instead"
            )

        def rewrite() -> str:
            graph = node.graph
            flat = (
                bias if vb.dim() <= 1 else emit(graph, aten.reshape.default, bias, [vb.shape[-1]])
            )
            out = emit(graph, aten.addmm.default, flat, *mm.args[:2])
            # Reuse the original shape argument: it carries symbolic sizes as graph values.
            replace(node, emit(graph, view.target, out, view.args[1]))
            return f"bias {tuple(vb.shape)} moved before the reshape into addmm"

        return rewrite
