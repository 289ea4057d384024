"""Newton-Schulz work per rank: each matrix orthogonalised once in the job, and per rank exactly
what the distributed Muon engine itself orthogonalises on that rank (run on a fake process group,
one rank at a time, at world sizes no test could launch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyperparallel.optim.distributed import ShardedNewtonSchulz
from hyperparallel.optim.plan import shard_rows
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.inventory import Inventory, mesh_coords, model_inventory
from hyperparallel.plan.muon_work import ns_flops, ns_work
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug

LAYERS, EXPERTS = 4, 8


def _inventory(mesh: str, world: int) -> Inventory:
    cfg = load_config(
        debug(),
        overrides=[f"model.n_layers={LAYERS}", f"model.n_experts={EXPERTS}", "data.batch_size=4"],
    )
    return model_inventory(cfg, parse_mesh(mesh, world))


def _unique_matrices() -> int:
    """Per block qkv, proj and the router, and three stacks of EXPERTS experts."""
    return LAYERS * (3 + 3 * EXPERTS)


@pytest.mark.parametrize(
    ("mesh", "world"),
    [("fsdp", 8), ("2x4", 8), ("ep=4,dp_shard=2", 8), ("pp=2,dp_replicate=2,ep=2", 8)],
)
def test_each_matrix_is_orthogonalised_once(mesh: str, world: int):
    """Summed over ranks, every Muon matrix once; gather-all repeats all of them on every rank
    of a stage; the all-to-all scheme repeats dense matrices in every replica group."""
    inv = _inventory(mesh, world)
    work = ns_work(inv)
    assert sum(work.matrices) == _unique_matrices()
    assert work.redundancy == pytest.approx(1.0)
    gather = ns_work(inv, "gather-all")
    assert sum(gather.matrices) == _unique_matrices() * world // inv.dims.pp
    assert gather.balance == pytest.approx(1.0)
    assert ns_work(inv, "all-to-all").redundancy >= 1.0


def test_flops_follow_the_kernel_shapes():
    """Tall matrices are transposed: ``[M, N]`` and ``[N, M]`` cost the same; 5 steps of
    ``4 m^2 n + 2 m^3``."""
    assert ns_flops(6, 4) == ns_flops(4, 6) == 5 * (4 * 16 * 6 + 2 * 64)


def _engine_counts(inv: Inventory, rank: int) -> int:
    """Matrices the real engine orthogonalises on ``rank``: DTensor updates placed as the job
    places them, on a fake process group (shapes only; no data moves)."""
    dims = inv.dims
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        meshes = dims.build("cpu")
        coords = mesh_coords(dims, rank)
        shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
        updates = []
        for p in inv.params_of(coords["pp"]):
            if p.optimizer != "muon":
                continue
            if p.expert:
                assert meshes.experts is not None
                mesh = meshes.experts
                names = mesh.mesh_dim_names or ()
                placements = [Shard(0) if n in ("ep", "dp_shard") else Replicate() for n in names]
                rows = p.shape[0] // (dims.ep * dims.dp_shard)
            else:
                mesh = meshes.dense
                placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
                rows = shard_rows(p.shape[0], dims.ep * dims.dp_shard)[shard_rank]
            local = torch.zeros(rows, *p.shape[1:])
            full = torch.empty(p.shape, device="meta")
            updates.append(
                DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
                )
            )
        engine = ShardedNewtonSchulz(lambda matrices: matrices)
        engine(updates, updates)
        return engine.ns_matrices
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    torch.__version__ < "2.10",
    reason="torch 2.9's DeviceMesh cannot resolve the sub-mesh groups of a fake process group",
)
@pytest.mark.parametrize(
    ("mesh", "world"),
    [("2x4", 8), ("dp_replicate=2,ep=2,dp_shard=2", 8), ("pp=2,dp_replicate=3,dp_shard=2", 12)],
)
def test_per_rank_work_is_the_engines(mesh: str, world: int):
    """Per rank, the planner's matrix count equals the engine's own count on that rank."""
    inv = _inventory(mesh, world)
    predicted = ns_work(inv).matrices
    assert [_engine_counts(inv, rank) for rank in range(world)] == list(predicted)
