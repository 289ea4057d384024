"""What mfusion did to each compiled graph: rewrites, refusals with reasons, fused regions."""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Decision:
    """One pattern a pass recognised, and whether it rewrote it."""

    pass_name: str
    node: str
    rewritten: bool
    reason: str
    """For a rewrite, what it became; for a refusal, why the match was not safe to rewrite."""


@dataclasses.dataclass(frozen=True)
class RegionSummary:
    """One region planned by automatic fusion."""

    kind: str
    ops: int
    backend: str
    outlined: bool
    reason: str


@dataclasses.dataclass
class GraphReport:
    """Everything mfusion recorded while rewriting one post-grad graph."""

    index: int
    backend: str
    ops_before: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    ops_after: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    regions: list[RegionSummary] = dataclasses.field(default_factory=list)
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    machine: str = ""
    """The machine profile the machine-dependent rewrites decided for (see mfusion.machine)."""
    whole_graph: str = ""
    """The whole-graph check of a kernel-generating backend: kept or put back, and why."""

    def rewritten(self, pass_name: str | None = None) -> int:
        """Number of rewrites, by one pass or all."""
        return sum(d.rewritten for d in self.decisions if pass_name in (None, d.pass_name))

    def refused(self, pass_name: str | None = None) -> list[Decision]:
        """Matches a pass recognised but left alone."""
        return [d for d in self.decisions if not d.rewritten and pass_name in (None, d.pass_name)]

    def matched(self, pass_name: str | None = None) -> int:
        """Rewritten plus refused: every pattern a pass recognised."""
        return sum(1 for d in self.decisions if pass_name in (None, d.pass_name))

    @property
    def fusions(self) -> int:
        """Rewrites plus outlined regions: the number reported as 'fusions applied'."""
        return self.rewritten() + sum(r.outlined for r in self.regions)

    def summary(self) -> str:
        """Human-readable digest: per pass matched/rewritten/refused, refusals with reasons."""
        names = sorted({d.pass_name for d in self.decisions})
        lines = [
            f"graph {self.index} (backend {self.backend}): "
            f"{sum(self.ops_before.values())} -> {sum(self.ops_after.values())} ops"
        ]
        if self.machine:
            lines.append(f"  machine: {self.machine}")
        for name in names:
            lines.append(
                f"  {name}: matched {self.matched(name)}, rewritten {self.rewritten(name)}, "
                f"refused {len(self.refused(name))}"
            )
            lines.extend(f"    refused {d.node}: {d.reason}" for d in self.refused(name))
        for region in self.regions:
            state = "outlined" if region.outlined else "kept for Inductor"
            lines.append(f"  region {region.kind} ({region.ops} ops): {state}; {region.reason}")
        if self.whole_graph:
            lines.append(f"  whole graph: {self.whole_graph}")
        return "\n".join(lines)


class Report:
    """The graphs compiled since the last :func:`clear_report`, oldest first."""

    def __init__(self, graphs: list[GraphReport]) -> None:
        self.graphs = graphs

    def __iter__(self) -> Iterator[GraphReport]:
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int) -> GraphReport:
        return self.graphs[index]

    def rewritten(self, pass_name: str | None = None) -> int:
        return sum(g.rewritten(pass_name) for g in self.graphs)

    @property
    def fusions(self) -> int:
        return sum(g.fusions for g in self.graphs)

    def __str__(self) -> str:
        if not self.graphs:
            return "mfusion: no graph compiled (or every graph came from Inductor's cache)"
        return "\n".join(g.summary() for g in self.graphs)


_LOCK = threading.Lock()
_GRAPHS: list[GraphReport] = []


def new_graph_report(backend: str) -> GraphReport:
    """Start the record for the next compiled graph."""
    with _LOCK:
        record = GraphReport(index=len(_GRAPHS), backend=backend)
        _GRAPHS.append(record)
    return record


def report() -> Report:
    """Per compiled graph: what each pass matched, rewrote or refused (and why), and regions.

    Graphs Inductor served from its FX cache did not run the passes and have no entry.
    """
    with _LOCK:
        return Report(list(_GRAPHS))


def clear_report() -> None:
    """Forget all recorded graphs."""
    with _LOCK:
        _GRAPHS.clear()
