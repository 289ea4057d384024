"""Cast absorption: ``mm(a.float(), b.float()).to(bf16)`` runs as a bf16 matmul.

CPU and GPU bf16/fp16 GEMMs accumulate in fp32 and round once, exactly what the up-cast chain
spells out; absorbing the casts avoids materialising two fp32 copies of the operands.

Machine-dependent: the rewrite trades an fp32 GEMM for a bf16/fp16 one, which pays only where
the device multiplies that dtype natively. On a CPU without AVX-512 BF16/AMX (or with oneDNN
capped below it) oneDNN emulates the bf16 GEMM: bf16 256x1024x256 took 70 ms there against
0.7 ms with AVX-512 BF16, far more than the two casts it saves. So the pass asks
:func:`mfusion.machine.native_gemm` for the graph's device and the config's machine profile,
and keeps the fp32 GEMM where the answer is no (the profile is in the pass manager's uuid).
"""

from __future__ import annotations

import torch
from torch import fx

from mfusion.config import MFusionConfig
from mfusion.machine import native_gemm
from mfusion.passes._graph import (
    LOW_PRECISION,
    aten,
    cast_target,
    dtype_of,
    emit,
    is_op,
    replace,
    tensor_val,
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite

MATMULS = (aten.mm.default, aten.bmm.default)


class MatMulCastPass(MFusionPass):
    """Anchor on the down-cast of an up-cast matmul."""

    name = "matmul_cast"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        target = cast_target(node)
        mm = node.args[0]
        if target is None or not is_op(mm, *MATMULS):
            return None
        ups = [u for u in mm.args[:2] if isinstance(u, fx.Node)]  # only nodes can be casts
        if len(ups) != 2 or not all(cast_target(u) == torch.float32 for u in ups):
            return None
        sources = [dtype_of(u.args[0]) for u in ups]
        if target not in LOW_PRECISION or sources != [target, target]:
            raise Refusal(f"casts {sources} -> fp32 -> {target}: not a round trip of one dtype")
        if len(mm.users) != 1:
            raise Refusal("the fp32 product is also used elsewhere; absorbing would change it")
        if not config.absorb_matmul_casts:
            raise Refusal("disabled by absorb_matmul_casts=False")
        machine = config.resolved_machine()
        product = tensor_val(mm)
        if product is None:
            return None  # no recorded value: the device is unknown
        device = product.device
        if not native_gemm(machine, target, device):
            raise Refusal(
                f"no native {target} GEMM on {device.type} ({machine.describe()}): an emulated "
                "low-precision GEMM costs more than the fp32 one with its casts"
            )

        def rewrite() -> str:
            replace(node, emit(node.graph, mm.target, ups[0].args[0], ups[1].args[0]))
            return f"{mm.target} in {target} without fp32 operand copies"

        return rewrite
