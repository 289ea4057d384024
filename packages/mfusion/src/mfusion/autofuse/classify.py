"""Region kinds and how one node or a whole region is classified."""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch
from torch import fx

from mfusion.passes._graph import tensor_val


class RegionKind(enum.StrEnum):
    """What a node (or region) computes, ordered from cheapest to most demanding to fuse."""

    RESHAPE = "reshape"
    ELEMENTWISE = "elementwise"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    MATMUL = "matmul"


_RANK = {kind: i for i, kind in enumerate(RegionKind)}


def node_kind(node: fx.Node, base: RegionKind) -> RegionKind:
    """Refine a capability's kind: an elementwise op whose inputs broadcast is BROADCAST."""
    if base is not RegionKind.ELEMENTWISE:
        return base
    out = tensor_val(node)
    if out is None:
        return base
    for arg in node.all_input_nodes:
        value = tensor_val(arg)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(out.shape):
            return RegionKind.BROADCAST
    return base


def region_kind(kinds: Iterable[RegionKind]) -> RegionKind:
    """A region is as demanding as its most demanding node (matmul > reduce > broadcast > ...)."""
    return max(kinds, key=_RANK.__getitem__, default=RegionKind.RESHAPE)
