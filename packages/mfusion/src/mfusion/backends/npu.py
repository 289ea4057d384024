"""Ascend NPU backend: available only when torch_npu imports and sees a device.

Regions are planned with the NPU capability table (fp16/bf16/fp32, rank <= 8) and left in the
graph for torch_npu's Inductor integration to generate kernels; the hand-written passes have
already put norms, RoPE and SwiGLU into the canonical forms it pattern-matches.
"""

from __future__ import annotations

from mfusion.autofuse.capability import NPU_TABLE
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.backends.base import KernelBackend, RegionCall


class NPUBackend(KernelBackend):
    name = "npu"
    table = NPU_TABLE

    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        return f"{kind.value} region left for torch_npu's Inductor backend"
