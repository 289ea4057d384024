"""Per-rank memory: shards as torch.chunk cuts them (FSDP2's Shard(0)), whole experts under ep,
each pipeline rank its own stages, Muon one state copy and AdamW two."""

from __future__ import annotations

import pytest
import torch

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.inventory import build_meta_model, mesh_coords, model_inventory
from hyperparallel.plan.memory import memory_by_rank, rank_memory
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug


@pytest.mark.parametrize(
    ("mesh", "world"),
    [("fsdp", 3), ("fsdp", 7), ("2x3", 6), ("ep=2,dp_shard=2", 4), ("pp=2,dp_shard=2", 4)],
)
def test_shards_and_state_follow_the_placements(mesh: str, world: int):
    """Parameter, gradient and optimizer bytes per rank against tensors chunked on dim 0."""
    cfg = load_config(debug(), overrides=["model.n_layers=2", "data.batch_size=4"])
    dims = parse_mesh(mesh, world)
    meta = build_meta_model(cfg, dims)
    inv = model_inventory(cfg, dims, meta)
    shards = dims.ep * dims.dp_shard
    for rank in range(world):
        coords = mesh_coords(dims, rank)
        shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
        params = state = 0
        for p in inv.params:
            if p.stage not in inv.stages_of(coords["pp"]):
                continue
            full = torch.empty(p.shape, device="meta")
            if p.expert:  # whole experts: this rank's slice of the ep x dp_shard split
                local = full.chunk(shards)[shard_rank]
            else:
                chunks = full.chunk(shards)
                local = chunks[shard_rank] if shard_rank < len(chunks) else full[:0]
            nbytes = local.numel() * p.itemsize
            params += nbytes
            state += nbytes * (1 if p.optimizer == "muon" else 2)
        memory = rank_memory(meta, inv, cfg.activation, rank)
        assert memory == memory_by_rank(meta, inv, cfg.activation)[rank]
        assert (memory.params, memory.grads, memory.optimizer) == (params, params, state)
        assert memory.peak > memory.params + memory.grads + memory.optimizer


def test_recompute_moves_block_activations_off_the_device():
    """The same layout with every block recomputed keeps fewer device bytes, and what left the
    device is counted as recomputed."""
    dims = parse_mesh("fsdp", 2)
    results = {}
    for policy in ("none", "recompute"):
        cfg = load_config(debug(), overrides=[f"activation.policy={policy!r}"])
        meta = build_meta_model(cfg, dims)
        results[policy] = rank_memory(meta, model_inventory(cfg, dims, meta), cfg.activation, 0)
    plain, recomputed = results["none"].activations, results["recompute"].activations
    assert recomputed.device < plain.device and recomputed.recomputed > 0 and plain.recomputed == 0
