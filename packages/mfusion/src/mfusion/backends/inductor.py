"""The default backend: regions stay in the graph, so Inductor generates their fused kernels.

On CPU an opaque call into eager kernels inside an Inductor graph was measured ~80x slower than
Inductor's own fused loop (RMSNorm on [4096, 1024]: 80 ms vs 1 ms), so this backend never
outlines. Its capability table still drives region planning and the report.

Universal: an opaque call splits Inductor's fused loop and adds a pass over memory on any machine;
the 80x was one CPU's size of that, not the reason.
"""

from __future__ import annotations

from mfusion.autofuse.capability import INDUCTOR_TABLE
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.backends.base import KernelBackend, RegionCall


class InductorBackend(KernelBackend):
    name = "inductor"
    table = INDUCTOR_TABLE

    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        return f"{kind.value} region left in place: Inductor emits its fused kernel"
