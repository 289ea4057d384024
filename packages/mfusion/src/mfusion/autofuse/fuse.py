"""Automatic fusion: capability filter, region growth, splitting, classification, outlining."""

from __future__ import annotations

from torch import fx

from mfusion.autofuse.capability import CapabilityTable, OpCapability
from mfusion.autofuse.classify import RegionKind, node_kind, region_kind
from mfusion.autofuse.cluster import grow_regions
from mfusion.autofuse.outline import extract_region, replace_with_call
from mfusion.autofuse.split import split_region
from mfusion.backends.registry import get_backend
from mfusion.config import MFusionConfig
from mfusion.report import GraphReport, RegionSummary


def candidate_kinds(graph: fx.Graph, table: CapabilityTable) -> dict[fx.Node, RegionKind]:
    """Nodes the backend's capability table accepts, with their refined kinds."""
    kinds = {}
    for node in graph.nodes:
        cap = table.check(node)
        if isinstance(cap, OpCapability):
            kinds[node] = node_kind(node, cap.kind)
    return kinds


def auto_fuse(graph: fx.Graph, config: MFusionConfig, record: GraphReport) -> int:
    """Plan regions for the configured backend and outline those the backend compiles.

    Returns:
        Number of regions outlined (replaced by one call each).
    """
    backend = get_backend(config.resolved_backend())
    backend.machine = config.machine  # None: the backend detects this process's when needed
    kinds = candidate_kinds(graph, backend.table)
    regions = grow_regions(
        graph,
        kinds,
        max_ops=config.max_region_ops,
        matmul_epilogue_only=backend.table.matmul_epilogue_only,
    )
    outlined = 0
    for region in regions:
        compute = [n for n in region.nodes if kinds[n] is not RegionKind.RESHAPE]
        if len(compute) < config.min_region_ops:
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        for piece in split_region(region.nodes, order, min_ops=config.min_region_ops):
            kind = region_kind(kinds[n] for n in piece)
            extracted = extract_region(piece)
            result = backend.compile_region(extracted, kind)
            if isinstance(result, str):
                record.regions.append(
                    RegionSummary(kind.value, len(piece), backend.name, False, result)
                )
                continue
            target, extra_args = result
            replace_with_call(graph, extracted, target, extra_args)
            outlined += 1
            record.regions.append(
                RegionSummary(
                    kind.value,
                    len(piece),
                    backend.name,
                    True,
                    getattr(backend, "last_note", "compiled by backend"),
                )
            )
    return outlined
