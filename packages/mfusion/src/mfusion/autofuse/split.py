"""Split a region with no single legal insertion point into pieces that each have one.

Outlining replaces a region by one call placed in the graph's existing order: after every
producer of the region's inputs and before every outside user of its outputs. In a fixed node
order that window can be empty even when the region is acyclic. Dynamic programming over the
region's members (in graph order) then picks contiguous pieces with a non-empty window, keeping
the most ops in the fewest pieces; members in no piece stay outside (with Inductor).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx


def insertion_window(nodes: Sequence[fx.Node], order: dict[fx.Node, int]) -> tuple[int, int]:
    """``(lo, hi)``: the call may go after position ``lo`` and must precede position ``hi``."""
    members = set(nodes)
    lo = max((order[p] for n in nodes for p in n.all_input_nodes if p not in members), default=-1)
    hi = min((order[u] for n in nodes for u in n.users if u not in members), default=len(order) + 1)
    return lo, hi


def has_insertion_point(nodes: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    lo, hi = insertion_window(nodes, order)
    return lo < hi


def split_region(
    nodes: Sequence[fx.Node], order: dict[fx.Node, int], min_ops: int = 1
) -> list[list[fx.Node]]:
    """Contiguous pieces of ``nodes`` (sorted by ``order``), each with a legal insertion point.

    Maximises the number of nodes covered, then minimises the number of pieces; pieces smaller
    than ``min_ops`` are not formed.
    """
    nodes = sorted(nodes, key=order.__getitem__)
    if has_insertion_point(nodes, order):
        return [list(nodes)] if len(nodes) >= min_ops else []
    n = len(nodes)
    # best[i] = (covered, -pieces, cut) for the first i nodes; cut rebuilds the choice.
    # best[0]'s cut is never read: the walk back stops at i == 0
    best: list[tuple[int, int, tuple[int, int]]] = [(0, 0, (0, -1))] * (n + 1)
    for i in range(1, n + 1):
        best[i] = (best[i - 1][0], best[i - 1][1], (i - 1, -1))  # node i-1 left out
        for j in range(i - min_ops, -1, -1):
            piece = nodes[j:i]
            if not has_insertion_point(piece, order):
                continue
            candidate = (best[j][0] + (i - j), best[j][1] - 1, (j, i))
            if candidate[:2] > best[i][:2]:
                best[i] = candidate
    pieces: list[list[fx.Node]] = []
    i = n
    while i > 0:
        j, end = best[i][2]
        if end == -1:
            i -= 1
        else:
            pieces.append(list(nodes[j:end]))
            i = j
    return pieces[::-1]
