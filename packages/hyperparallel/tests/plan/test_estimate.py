"""The step-time estimate: ring wire bytes, link choice by node, and the parts it adds up."""

from __future__ import annotations

import pytest

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.collectives import CollectiveBytes
from hyperparallel.plan.estimate import comm_seconds, group_span, wire_bytes
from hyperparallel.plan.inventory import model_inventory
from hyperparallel.plan.measure import group_ranks
from hyperparallel.plan.planner import make_plan
from hyperparallel.plan.profiles import load_profile, profile_names
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug


@pytest.mark.parametrize(
    ("kind", "ranks", "expected"),
    [("all_gather", 4, 300), ("reduce_scatter", 4, 75), ("all_reduce", 4, 150),
     ("all_to_all", 4, 75), ("send", 2, 100), ("recv", 2, 0), ("all_gather", 1, 0)],
)  # fmt: skip
def test_ring_wire_bytes(kind: str, ranks: int, expected: float):
    """Bytes a rank sends for 100 input bytes, as ring algorithms move them."""
    assert wire_bytes(kind, 100, ranks) == pytest.approx(expected)


def test_groups_inside_a_node_use_the_node_link():
    """On 16 ranks of 8-device nodes, dp_shard=8 stays in a node and dp_replicate=2 crosses."""
    profile = load_profile("h100")
    cfg = load_config(debug(), overrides=["data.batch_size=1"])
    plan = make_plan(cfg, parse_mesh("2x8", 16), profile)
    inv = plan.inventory
    one = [CollectiveBytes("fsdp", "all_reduce", "dp_shard", 1, 10**9)]
    across = [CollectiveBytes("hsdp", "all_reduce", "dp_replicate", 1, 10**9)]
    inside = comm_seconds(inv, one, 0, profile)["fsdp"]
    outside = comm_seconds(inv, across, 0, profile)["hsdp"]
    assert inside == pytest.approx(2 * 7 / 8 * 1e9 / profile.intra_node_bandwidth.value)
    assert outside == pytest.approx(1e9 / profile.inter_node_bandwidth.value)


def test_pipeline_bubble_and_profiles():
    """1F1B adds (pp - 1) / microbatches of the compute; every shipped profile loads and names
    a source for each figure."""
    cfg = load_config(debug(), overrides=["model.n_layers=4", "parallel.microbatches=4"])
    plan = make_plan(cfg, parse_mesh("pp=2", 2), load_profile("h200"))
    for e in plan.estimates.values():
        assert e.bubble == pytest.approx(e.compute / 4)
        assert e.total >= e.compute + e.bubble
    for name in profile_names()[:-1]:  # cpu is measured, not shipped
        profile = load_profile(name)
        figures = [
            getattr(profile, f)
            for f in type(profile).model_fields
            if f.endswith(("flops", "bytes", "bandwidth"))
        ]
        assert all(f.source.split(":")[0] in ("published", "assumed") for f in figures)


@pytest.mark.parametrize("name", ["pp", "dp_replicate", "ep", "dp_shard", "dp_shard_ep", "dp"])
def test_group_span_matches_the_group_members(name: str):
    """Size and extent of each rank's group, against the members the measurement harness lists
    (every rank of the world compared coordinate by coordinate)."""
    cfg = load_config(debug(), overrides=["data.batch_size=4", "model.n_layers=2"])
    dims = parse_mesh("pp=2,dp_replicate=3,ep=2,dp_shard=2", 24)
    inv = model_inventory(cfg, dims)
    for rank in range(dims.world_size):
        members = group_ranks(dims, name, rank)
        assert group_span(inv, name, rank) == (len(members), min(members), max(members))
