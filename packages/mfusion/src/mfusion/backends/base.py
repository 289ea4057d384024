"""The interface every kernel backend implements."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from torch.fx.node import Argument

from mfusion.autofuse.capability import CapabilityTable
from mfusion.autofuse.classify import RegionKind
from mfusion.autofuse.outline import OutlinedRegion
from mfusion.machine import MachineProfile

# A compiled region is the op to call and the extra (non-tensor) arguments after its inputs;
# a string instead says why the backend leaves the region to Inductor.
RegionCall = tuple[Callable[..., Any], tuple[Argument, ...]]


class KernelBackend(abc.ABC):
    """Takes fused regions and either returns a call that runs them or a reason to decline.

    Declining is always safe: the region's nodes stay in the graph and Inductor compiles them.
    """

    name: str
    table: CapabilityTable
    whole_graph_check: bool = False
    """Time the whole graph with and without this backend's outlined regions and keep the
    faster (:func:`mfusion.mlir.choice.decide_graph`): for backends whose per-region choice
    cannot see the fusion an outlined region breaks around it."""
    machine: MachineProfile | None = None
    """The profile measured decisions hold for (set from the config by ``auto_fuse``; None:
    this process's, detected when needed)."""

    @abc.abstractmethod
    def compile_region(self, region: OutlinedRegion, kind: RegionKind) -> RegionCall | str:
        """Compile ``region`` (a stand-alone graph module) or say why not."""
