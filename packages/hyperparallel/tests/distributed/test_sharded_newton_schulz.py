"""Distributed NS on real gloo ranks: same result as single-process NS, each matrix once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from hyperparallel.optim.distributed import ShardedNewtonSchulz
from hyperparallel.optim.plan import shard_rows
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch

pytestmark = pytest.mark.distributed

KELLER = (3.4445, -4.775, 2.0315)
# Uneven rows (5 and 3 on 4 ranks: empty shards), repeated shapes, a conv weight, and experts.
SHAPES = [(16, 8), (5, 12), (3, 7), (16, 8), (8, 16), (6, 2, 3, 3), (4, 6, 5)]


def _reference_ns(matrix: torch.Tensor) -> torch.Tensor:
    if matrix.ndim == 3:
        return torch.stack([_reference_ns(m) for m in matrix])
    flat = matrix.reshape(matrix.shape[0], -1)
    return _zeropower_via_newtonschulz(flat, KELLER, 5, 1e-7).float().reshape(matrix.shape)


def _updates() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _run(mesh_shape: tuple[int, ...], batch_bytes: int | None) -> tuple[list, int]:
    calls = []

    def local(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.extend(m.shape for m in matrices)
        return [_reference_ns(m) for m in matrices]

    if len(mesh_shape) == 1:
        mesh, placements = ParallelDims(dp_shard=mesh_shape[0]).build("cpu").dense, [Shard(0)]
    else:
        replicas, shards = mesh_shape
        mesh = ParallelDims(dp_replicate=replicas, dp_shard=shards).build("cpu").dense
        placements = [Replicate(), Shard(0)]
    updates = [distribute_tensor(u, mesh, placements) for u in _updates()]
    engine = ShardedNewtonSchulz(local, batch_bytes=batch_bytes)
    outs = engine(updates, updates)
    again = engine(updates, updates)  # cached plan path
    full = [o.full_tensor() for o in outs]
    assert all(torch.equal(a.full_tensor(), f) for a, f in zip(again, full, strict=True))
    assert all(o.placements == u.placements for o, u in zip(outs, updates, strict=True))
    ns_runs = torch.tensor([float(len(calls))])
    dist.all_reduce(ns_runs)
    return [f.tolist() for f in full], int(ns_runs.item())


@pytest.mark.parametrize(
    ("world", "mesh_shape", "batch_bytes"),
    [(4, (4,), 600), (4, (2, 2), None), (3, (3,), None)],
)
def test_sharded_ns_matches_single_process(world, mesh_shape, batch_bytes):
    """FSDP2 (1-D) and HSDP (2-D) results equal single-process NS; uneven and empty shards work."""
    results = launch(_run, world, mesh_shape, batch_bytes, timeout=120)
    expected = [_reference_ns(u) for u in _updates()]
    for full, _ in results:
        for got, want in zip(full, expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
    # Each whole matrix is orthogonalised once in the job (two steps were run); expert shards
    # are whole matrices on their own rank, so they count once per rank holding some.
    gathered = sum(1 for s in SHAPES if len(s) != 3)
    experts_blocks = sum(1 for rows in shard_rows(SHAPES[-1][0], world) if rows)
    assert results[0][1] == 2 * (gathered + experts_blocks)


def _two_meshes() -> list:
    first, second = (ParallelDims(dp_shard=2).build("cpu").dense for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 4, generator=generator), torch.randn(5, 3, generator=generator)]
    updates = [
        distribute_tensor(full[0], first, [Shard(0)]),
        distribute_tensor(full[1], second, [Shard(0)]),
    ]
    outs = ShardedNewtonSchulz(lambda ms: [_reference_ns(m) for m in ms])(updates, updates)
    return [o.full_tensor().tolist() for o in outs]


def test_parameters_on_different_meshes_are_each_orthogonalised():
    """Parameters on two meshes (e.g. experts on their own mesh) are planned per mesh."""
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 4, generator=generator), torch.randn(5, 3, generator=generator)]
    for result in launch(_two_meshes, 2, timeout=60):
        for got, matrix in zip(result, full, strict=True):
            torch.testing.assert_close(torch.tensor(got), _reference_ns(matrix), rtol=0, atol=1e-6)
