"""hyperparallel.plan.collectives and the group names it predicts under, without ranks."""

from __future__ import annotations

from hyperparallel.parallel.mesh import ParallelDims
from hyperparallel.plan.collectives import predict_collectives
from hyperparallel.plan.inventory import model_inventory
from hyperparallel.plan.measure import dim_name, dim_of_group, group_ranks
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug


def test_dimension_names_follow_the_ranks_they_group():
    """A flattened dimension whose other parts have size 1 is named by the part that is not."""
    fsdp, hsdp = ParallelDims(dp_shard=4), ParallelDims(dp_replicate=2, dp_shard=2)
    assert dim_name(fsdp, "dp_shard_ep") == "dp_shard"
    assert dim_name(ParallelDims(ep=2), "dp_shard_ep") == "ep"
    assert dim_name(ParallelDims(ep=2, dp_shard=2), "dp_shard_ep") == "dp_shard_ep"
    assert dim_name(ParallelDims(pp=2), "dp_shard_ep") == "self"
    assert group_ranks(hsdp, "dp_replicate", 1) == (1, 3)
    assert group_ranks(hsdp, "dp_shard", 1) == (0, 1)
    assert dim_of_group(hsdp, (1, 3), 3) == "dp_replicate"
    assert dim_of_group(ParallelDims(pp=2, dp_shard=2), (0, 1, 2, 3), 0) == "world"


def test_fsdp_bytes_are_padded_dim0_shards_per_unit():
    """Two blocks and a root on 3 ranks: rows padded to ceil(rows / 3); blocks gathered twice."""
    cfg = load_config(debug(), overrides=["model.n_layers=2", "parallel.mesh='fsdp'"])
    dims = ParallelDims(dp_shard=3)
    inventory = model_inventory(cfg, dims)
    root = block = 0
    for p in inventory.params:
        shard = -(-p.shape[0] // 3) * (p.numel // p.shape[0]) * p.itemsize
        if p.fsdp_unit:
            block += shard
        else:
            root += shard
    found = {(c.source, c.kind): c for c in predict_collectives(cfg, dims, inventory, 0)}
    gather = found[("fsdp", "all_gather")]
    assert (gather.dim, gather.calls, gather.bytes) == ("dp_shard", 5, root + 2 * block)
    scatter = found[("fsdp", "reduce_scatter")]
    assert (scatter.calls, scatter.bytes) == (3, 3 * (root + block))


def test_v_schedule_passes_its_turn_in_memory():
    """DualPipeV on pp=2 holds stages (0, 3) and (1, 2): of three boundaries, the middle one
    stays on rank 1, so each rank crosses twice per micro-batch in each direction; interleaved
    (0, 2) / (1, 3) crosses at all three boundaries, three stage sides on each rank."""
    sends = {}
    for schedule in ("dualpipev", "interleaved_1f1b"):
        cfg = load_config(
            debug(),
            overrides=[
                "model.n_layers=4",
                "parallel.microbatches=4",
                f"parallel.pp_schedule={schedule!r}",
            ],
        )
        dims = ParallelDims(pp=2)
        inventory = model_inventory(cfg, dims)
        for rank in (0, 1):
            found = {c.kind: c for c in predict_collectives(cfg, dims, inventory, rank)}
            sends[(schedule, rank)] = (found["send"].calls, found["recv"].calls)
    assert sends[("dualpipev", 0)] == sends[("dualpipev", 1)] == (8, 8)
    assert sends[("interleaved_1f1b", 0)] == (12, 12)
    assert sends[("interleaved_1f1b", 1)] == (12, 12)


def test_experts_inside_fsdp_groups_are_gathered_over_dp_shard():
    """ep=2, dp_shard=2: each expert stack stores E / 4 experts, gathers to E / 2 per forward
    and reduce-scatters the E / 2 gradient; HSDP adds an all-reduce of the shard."""
    cfg = load_config(debug(), overrides=["model.n_layers=2"])
    for dims in (ParallelDims(ep=2, dp_shard=2), ParallelDims(dp_replicate=2, ep=2)):
        inventory = model_inventory(cfg, dims)
        stacks = [p for p in inventory.params if p.expert]
        shard = sum(p.nbytes // (dims.ep * dims.dp_shard) for p in stacks)
        found = {
            (c.kind, c.dim): c
            for c in predict_collectives(cfg, dims, inventory, 0)
            if c.source.startswith("expert_")
        }
        if dims.dp_shard > 1:
            assert (
                found[("all_gather", "dp_shard")].calls,
                found[("all_gather", "dp_shard")].bytes,
            ) == (len(stacks), shard)
            assert found[("reduce_scatter", "dp_shard")].bytes == 2 * shard
        else:
            assert set(found) == {("all_reduce", "dp_replicate")}
            assert found[("all_reduce", "dp_replicate")].bytes == shard
