"""Automatic fusion on crafted graphs: capability filter, cycles, diamonds, multi-output
regions, insertion-point splits, classification and outlining."""

from __future__ import annotations

import operator

import torch
from torch import fx

from mfusion.autofuse.capability import INDUCTOR_TABLE, MLIR_CPU_TABLE, ShapeRefusal
from mfusion.autofuse.classify import RegionKind, region_kind
from mfusion.autofuse.cluster import UnionFind, creates_cycle, grow_regions
from mfusion.autofuse.fuse import candidate_kinds
from mfusion.autofuse.outline import extract_region, replace_with_call
from mfusion.autofuse.split import has_insertion_point, split_region

aten = torch.ops.aten


def _nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_union_find_merges_and_finds():
    uf = UnionFind()
    for item in "abcd":
        uf.add(item)
    uf.union("a", "b")
    uf.union("c", "d")
    assert uf.find("a") == uf.find("b") != uf.find("c")
    uf.union("b", "d")
    assert len({uf.find(i) for i in "abcd"}) == 1


def test_merge_through_outside_node_is_a_cycle(harness):
    """a -> matmul (not fusable) -> c and a -> c: fusing {a, c} would need the matmul's output
    before producing it."""

    def fn(x, w):
        a = torch.exp(x)
        b = a @ w
        return torch.tanh(a) + b

    gm = harness.trace(fn, torch.randn(4, 4), torch.randn(4, 4))
    nodes, order = _nodes(gm), _order(gm)
    assert creates_cycle({nodes["exp"], nodes["add"]}, order)
    assert not creates_cycle({nodes["exp"], nodes["tanh"]}, order)
    kinds = {n: RegionKind.ELEMENTWISE for n in (nodes["exp"], nodes["tanh"], nodes["add"])}
    regions = grow_regions(gm.graph, kinds, max_ops=16)
    for region in regions:
        assert not creates_cycle(region.members, order)
    assert not any({nodes["exp"], nodes["add"]} <= r.members for r in regions)


def test_diamond_fuses_into_one_region(harness):
    """x -> (exp, sin) -> add: both branches and the join form one region."""
    gm = harness.trace(lambda x: torch.exp(x) + torch.sigmoid(x) * 2, torch.randn(8))
    kinds = candidate_kinds(gm.graph, INDUCTOR_TABLE)
    regions = grow_regions(gm.graph, kinds, max_ops=16)
    assert len(regions) == 1 and len(regions[0].nodes) == 4


def test_region_size_limit_splits_growth(harness):
    gm = harness.trace(lambda x: torch.exp(torch.exp(torch.exp(torch.exp(x)))), torch.randn(8))
    kinds = candidate_kinds(gm.graph, INDUCTOR_TABLE)
    assert [len(r.nodes) for r in grow_regions(gm.graph, kinds, max_ops=2)] == [2, 2]


def test_capability_table_filters_by_op_dtype_and_shape(harness):
    """mlir-cpu takes fp32 elementwise/reduce/2-D matmul with static shapes; no bmm, no bf16."""

    def fn(x, w):
        return torch.exp(x @ w).sum(-1)

    gm = harness.trace(fn, torch.randn(4, 4), torch.randn(4, 4))
    nodes = _nodes(gm)
    assert MLIR_CPU_TABLE.check(nodes["mm"]).kind is RegionKind.MATMUL
    bmm = _nodes(harness.trace(torch.bmm, torch.randn(2, 4, 4), torch.randn(2, 4, 4)))["bmm"]
    assert MLIR_CPU_TABLE.check(bmm).startswith("aten.bmm.default is not in")
    assert MLIR_CPU_TABLE.check(nodes["exp"]).kind is RegionKind.ELEMENTWISE
    assert INDUCTOR_TABLE.check(nodes["mm"]).kind is RegionKind.MATMUL
    gm16 = harness.trace(fn, torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4).bfloat16())
    assert "dtype torch.bfloat16" in MLIR_CPU_TABLE.check(_nodes(gm16)["exp"])
    dyn = harness.trace(fn, torch.randn(4, 4), torch.randn(4, 4), mode="symbolic")
    # symbolic outer dims (a matmul's M) are taken; a symbolic innermost dim, K or N is not
    refusal = MLIR_CPU_TABLE.check(_nodes(dyn)["exp"])
    assert isinstance(refusal, ShapeRefusal) and refusal.startswith("symbolic inner dim s")
    refusal = MLIR_CPU_TABLE.check(_nodes(dyn)["mm"])
    assert isinstance(refusal, ShapeRefusal) and refusal.startswith("symbolic dim s")
    assert refusal.endswith("compiles matmul ops with a static K and N")


def test_matmul_only_leads_epilogue_regions(harness):
    """mm + elementwise epilogue fuse; a reduction after it starts a new region."""
    gm = harness.trace(lambda x, w: torch.relu(x @ w).sum(-1), torch.randn(4, 4), torch.randn(4, 4))
    kinds = candidate_kinds(gm.graph, INDUCTOR_TABLE)
    regions = grow_regions(gm.graph, kinds, max_ops=16)
    kinds_per_region = [region_kind(r.kinds.values()) for r in regions]
    assert RegionKind.MATMUL in kinds_per_region
    matmul_region = regions[kinds_per_region.index(RegionKind.MATMUL)]
    assert all(k is not RegionKind.REDUCE for k in matmul_region.kinds.values())


def test_classification_of_regions(harness):
    gm = harness.trace(lambda x, b: (torch.exp(x) + b).sum(-1), torch.randn(4, 8), torch.randn(8))
    kinds = candidate_kinds(gm.graph, INDUCTOR_TABLE)
    nodes = _nodes(gm)
    assert kinds[nodes["exp"]] is RegionKind.ELEMENTWISE
    assert kinds[nodes["add"]] is RegionKind.BROADCAST
    assert region_kind(kinds.values()) is RegionKind.REDUCE


def _split_graph(harness) -> fx.GraphModule:
    """a = exp(x); m = a @ w (outside); c = tanh(y @ w) ... arranged so that {a, c} has no
    single insertion point: c's input is produced after a's outside user."""

    def fn(x, y, w):
        a = torch.exp(x)
        m = a @ w  # outside user of a: the call must precede it
        late = y @ w  # produced after m: c needs it, so the call must follow it
        c = torch.tanh(late)
        return m, c

    return harness.trace(fn, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))


def test_region_without_insertion_point_is_split(harness):
    gm = _split_graph(harness)
    nodes, order = _nodes(gm), _order(gm)
    region = [nodes["exp"], nodes["tanh"]]
    assert not creates_cycle(set(region), order)
    assert not has_insertion_point(region, order)
    pieces = split_region(region, order)
    assert pieces == [[nodes["exp"]], [nodes["tanh"]]]
    assert split_region(region, order, min_ops=2) == []


def test_split_keeps_most_ops_in_fewest_pieces(harness):
    """Five ops where only the middle boundary is illegal: two pieces covering all five."""

    def fn(x, y, w):
        a = torch.exp(x)
        b = torch.sin(a)
        m = b @ w
        late = y @ w
        c = torch.tanh(late)
        d = torch.cos(c)
        e = torch.neg(d)
        return m, e

    gm = harness.trace(fn, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    nodes, order = _nodes(gm), _order(gm)
    region = [nodes[n] for n in ("exp", "sin", "tanh", "cos", "neg")]
    pieces = split_region(region, order)
    assert [[n.name for n in p] for p in pieces] == [["exp", "sin"], ["tanh", "cos", "neg"]]


def test_outline_multi_output_region_replaced_by_one_call(harness):
    """A region with two outside-used outputs becomes one call plus two getitems."""

    def fn(x):
        a = torch.exp(x)
        b = torch.sigmoid(a)
        return a * 2, b.sum()

    x = torch.randn(4, 4)
    gm = harness.trace(fn, x)
    nodes = _nodes(gm)
    region = extract_region([nodes["exp"], nodes["sigmoid"]])
    assert [o.name for o in region.outputs] == ["exp", "sigmoid"]
    torch.testing.assert_close(region.module(x), (torch.exp(x), torch.sigmoid(torch.exp(x))))
    lib = torch.library.Library("mfusion_test", "FRAGMENT")
    lib.define("region(Tensor[] xs) -> Tensor[]")
    lib.impl("region", lambda xs: list(region.module(*xs)), "CompositeExplicitAutograd")
    call = replace_with_call(gm.graph, region, torch.ops.mfusion_test.region.default, ())
    gm.recompile()
    assert sum(n.target is operator.getitem for n in gm.graph.nodes) == 2
    assert call.target is torch.ops.mfusion_test.region.default
    for got, ref in zip(gm(x), fn(x), strict=True):
        torch.testing.assert_close(got, ref)
