"""Automatic fusion: capability filter, region growth, splitting, classification, outlining,
and for backends that ask for it the whole-graph check (keep the outlined graph only if faster).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from mfusion.autofuse.capability import CapabilityTable, OpCapability, ShapeRefusal
from mfusion.autofuse.classify import RegionKind, node_kind, region_kind
from mfusion.autofuse.cluster import grow_regions
from mfusion.autofuse.outline import (
    OutlinedRegion,
    extract_region,
    inline_call,
    replace_with_call,
    snapshot,
)
from mfusion.autofuse.split import split_region
from mfusion.backends.base import KernelBackend
from mfusion.backends.registry import get_backend
from mfusion.config import MFusionConfig
from mfusion.report import GraphReport, RegionSummary


def candidate_kinds(
    graph: fx.Graph, table: CapabilityTable, refusals: list[ShapeRefusal] | None = None
) -> dict[fx.Node, RegionKind]:
    """Nodes the backend's capability table accepts, with their refined kinds; the reasons of
    nodes refused for their shape (:class:`ShapeRefusal`) are appended to ``refusals``."""
    kinds = {}
    for node in graph.nodes:
        cap = table.check(node)
        if isinstance(cap, OpCapability):
            kinds[node] = node_kind(node, cap.kind)
        elif isinstance(cap, ShapeRefusal) and refusals is not None:
            refusals.append(cap)
    return kinds


def _record_shape_refusals(refusals: list[ShapeRefusal], backend: str, record: GraphReport) -> None:
    """One report line per symbolic dim refused: a dynamic graph repeats it in many nodes, the
    first node's reason stands for them all, with their count."""
    by_dim: dict[str, list[ShapeRefusal]] = {}
    for refusal in refusals:
        by_dim.setdefault(refusal.dim, []).append(refusal)
    for group in by_dim.values():
        record.regions.append(
            RegionSummary("refused", len(group), backend, False, f"refused: {group[0]}")
        )


def auto_fuse(graph: fx.Graph, config: MFusionConfig, record: GraphReport) -> int:
    """Plan regions for the configured backend and outline those the backend compiles.

    Returns:
        Number of regions outlined (replaced by one call each) and kept.
    """
    backend = get_backend(config.resolved_backend())
    backend.machine = config.machine  # None: the backend detects this process's when needed
    plain = _plain_snapshot(graph, backend)
    calls: list[tuple[fx.Node, OutlinedRegion, int]] = []
    refusals: list[ShapeRefusal] = []
    kinds = candidate_kinds(graph, backend.table, refusals)
    _record_shape_refusals(refusals, backend.name, record)
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
            call = replace_with_call(graph, extracted, target, extra_args)
            calls.append((call, extracted, len(record.regions)))
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
    if calls and plain is not None and not _keep_outlined(graph, plain, backend, config, record):
        for call, outlined_region, _ in reversed(calls):
            inline_call(graph, call, outlined_region)
        for _, _, index in calls:
            summary = record.regions[index]
            record.regions[index] = dataclasses.replace(
                summary,
                outlined=False,
                reason=f"put back for Inductor by the whole-graph check; {summary.reason}",
            )
        return 0
    return outlined


def _plain_snapshot(graph: fx.Graph, backend: KernelBackend) -> fx.GraphModule | None:
    """The graph before outlining, when the backend asks for the whole-graph check and the
    choice is measured (``MFUSION_MLIR_CHOICE=always|never`` decide without timing)."""
    if not backend.whole_graph_check:
        return None
    from mfusion.mlir.choice import choice_mode

    return snapshot(graph) if choice_mode() == "measure" else None


def _keep_outlined(
    graph: fx.Graph,
    plain: fx.GraphModule,
    backend: KernelBackend,
    config: MFusionConfig,
    record: GraphReport,
) -> bool:
    """The whole-graph check: True to keep the outlined regions. Where it cannot measure, the
    regions are put back (Inductor's graph is the one known not to lose to Inductor)."""
    from mfusion.mlir.choice import decide_graph
    from mfusion.mlir.standalone import timing_inputs_refusal

    refusal = timing_inputs_refusal(plain)
    if refusal is not None:
        record.whole_graph = f"regions put back: cannot time the graph ({refusal})"
        return False
    machine = backend.machine if backend.machine is not None else config.resolved_machine()
    try:
        decision = decide_graph(plain, snapshot(graph), machine)
    except RuntimeError as error:
        record.whole_graph = f"regions put back: the graph did not compile or run ({error})"[:300]
        return False
    if decision.mlir_s is None or decision.inductor_s is None:  # not timed (NPU_CORE_DECISIONS)
        times = decision.source
    else:
        ratio = decision.mlir_s / decision.inductor_s
        times = (
            f"with regions {decision.mlir_s * 1e3:.3f} ms vs without "
            f"{decision.inductor_s * 1e3:.3f} ms (ratio {ratio:.3f}, {decision.source})"
        )
    verdict = "regions kept" if decision.use_mlir else "regions put back for Inductor"
    record.whole_graph = f"{verdict}: {times}"
    return decision.use_mlir
