"""Grow fusion regions over the FX dependency graph with union-find, rejecting cyclic merges.

Nodes are visited in graph order; each candidate tries to join the region of each candidate
producer. A merge is refused when the union would have a path that leaves it and comes back
(outlining it as one call would then need its own output as an input), when it would put a
matmul behind a reduction, or when the region would exceed the size limit.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from mfusion.autofuse.classify import RegionKind


class UnionFind:
    """Disjoint sets over hashable items with path halving and union by size."""

    def __init__(self) -> None:
        self.parent: dict[object, object] = {}
        self.size: dict[object, int] = {}

    def add(self, item: object) -> None:
        self.parent.setdefault(item, item)
        self.size.setdefault(item, 1)

    def find(self, item: object) -> object:
        while self.parent[item] is not item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: object, b: object) -> object:
        ra, rb = self.find(a), self.find(b)
        if ra is rb:
            return ra
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]
        return ra


@dataclasses.dataclass
class Region:
    """A set of nodes to fuse, in graph order, with per-node kinds."""

    nodes: list[fx.Node]
    kinds: dict[fx.Node, RegionKind]

    @property
    def members(self) -> set[fx.Node]:
        return set(self.nodes)


def creates_cycle(members: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """True if some path leaves ``members`` and re-enters it (a contraction cycle).

    The search only follows nodes positioned before the last member: a path that re-enters must
    end at a member, and graph order is topological.
    """
    limit = max(order[n] for n in members)
    stack = [u for n in members for u in n.users if u not in members and order[u] < limit]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user in members:
                return True
            if order[user] < limit:
                stack.append(user)
    return False


def grow_regions(
    graph: fx.Graph,
    kinds: dict[fx.Node, RegionKind],
    *,
    max_ops: int,
    matmul_epilogue_only: bool = True,
) -> list[Region]:
    """Partition the candidate nodes (keys of ``kinds``) into acyclic regions.

    Args:
        graph: The graph; its node order must be topological (FX guarantees it).
        kinds: Candidate nodes (those the backend's capability table accepts) and their kinds.
        max_ops: Largest region size.
        matmul_epilogue_only: Refuse merges that put a matmul after a reduction or a second
            matmul into a region.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    uf = UnionFind()
    sets: dict[object, set[fx.Node]] = {}
    for node in graph.nodes:
        if node not in kinds:
            continue
        uf.add(node)
        sets[node] = {node}
        for producer in node.all_input_nodes:
            if producer not in kinds:
                continue
            ra, rb = uf.find(node), uf.find(producer)
            if ra is rb:
                continue
            merged = sets[ra] | sets[rb]
            if len(merged) > max_ops:
                continue
            if matmul_epilogue_only and not _legal_matmul_mix(merged, kinds, order):
                continue
            if creates_cycle(merged, order):
                continue
            root = uf.union(ra, rb)
            sets[root] = merged
    regions = []
    for root, members in sets.items():
        if uf.find(root) is root:
            if matmul_epilogue_only:
                members = _without_trailing_views(members, kinds, order)
            nodes = sorted(members, key=order.__getitem__)
            regions.append(Region(nodes, {n: kinds[n] for n in nodes}))
    regions.sort(key=lambda r: order[r.nodes[0]])
    return regions


def _without_trailing_views(
    members: set[fx.Node], kinds: dict[fx.Node, RegionKind], order: dict[fx.Node, int]
) -> set[fx.Node]:
    """A matmul region without the views at its end: a view read only outside the region.

    In a backward graph the GEMM that produces a gradient is followed by the gradient's views
    for the next GEMMs (``dpre`` flattened, and ``dpre^T`` for the weight gradient). Inside the
    region such a view is an output of its own: torch-mlir writes a transposed copy of the
    result (a second transpose the GEMM lowering refuses: the region fell back to the scalar
    pipeline, 129x Inductor's time on BERT's FFN backward). Outside it is a free view of the
    region's output. Views are dropped from the end while that leaves the region acyclic.
    """
    if not any(kinds[n] is RegionKind.MATMUL for n in members):
        return members
    members = set(members)
    changed = True
    while changed:
        changed = False
        for node in sorted(members, key=order.__getitem__, reverse=True):
            if kinds[node] is not RegionKind.RESHAPE or any(u in members for u in node.users):
                continue
            rest = members - {node}
            if rest and not creates_cycle(rest, order):
                members, changed = rest, True
    return members


def _legal_matmul_mix(
    members: set[fx.Node], kinds: dict[fx.Node, RegionKind], order: dict[fx.Node, int]
) -> bool:
    """At most one matmul, no reduction next to it, and everything else is its epilogue or a
    view of one of its operands (:func:`_operand_view`)."""
    matmuls = [n for n in members if kinds[n] is RegionKind.MATMUL]
    if not matmuls:
        return True
    if len(matmuls) > 1 or any(kinds[n] is RegionKind.REDUCE for n in members):
        return False
    matmul = matmuls[0]
    first = order[matmul]
    return all(order[n] >= first or _operand_view(n, matmul, members, kinds) for n in members)


def _operand_view(
    node: fx.Node, matmul: fx.Node, members: set[fx.Node], kinds: dict[fx.Node, RegionKind]
) -> bool:
    """A view read only inside the region that forms a matmul operand: a linear's transposed
    weight (``permute`` as the right operand) or an activation flattened to 2-D.

    Left outside, such a view reaches the region as a strided input: the call then copies a
    transposed weight on every run, and the GEMM lowering reads its K x N panels unpacked
    (measured 2.1x of Inductor's time at 256 x 768 -> 3072 against 0.81x with the permute in).
    A permute of the left operand (a weight gradient's ``g^T``) joins too: the GEMM strategy
    reads it through the matmul's indexing map (:func:`mfusion.mlir.gemm.fold_left_transpose`).
    """
    if kinds[node] is not RegionKind.RESHAPE or not all(u in members for u in node.users):
        return False
    if node.target is not torch.ops.aten.permute.default:
        return True
    return node in matmul.args[-2:] and all(u is matmul for u in node.users)
