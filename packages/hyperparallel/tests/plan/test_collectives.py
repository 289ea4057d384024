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
