"""Muon on FSDP2 / HSDP parameters equals single-process Muon on the same model (conftest's
``mixed_shapes``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hyperparallel.optim import Muon
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch

pytestmark = pytest.mark.distributed


def _reference(mixed, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = mixed()
    opt = Muon(model.parameters(), lr=0.05, ns_dtype="bf16")
    for step in range(steps):
        for p, g in zip(model.parameters(), model.random_grads(step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sharded(mixed, dims: ParallelDims, steps: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = mixed()
    full = copy.deepcopy(model)
    fully_shard(model, mesh=dims.build("cpu").dense)
    opt = Muon(model.parameters(), lr=0.05, ns_dtype="bf16")
    for step in range(steps):
        for p, g in zip(model.parameters(), full.random_grads(step), strict=True):
            p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    dist.barrier()
    return [p.full_tensor().tolist() for p in model.parameters()]


@pytest.mark.parametrize(
    "dims",
    [ParallelDims(dp_shard=2), ParallelDims(dp_shard=4), ParallelDims(dp_replicate=2, dp_shard=2)],
)
def test_fsdp_and_hsdp_updates_equal_single_process(dims, mixed_shapes):
    """Three steps on FSDP world 2 and 4 and HSDP 2x2 match the single-process reference."""
    expected = _reference(mixed_shapes, 3)
    for rank_result in launch(_sharded, dims.world_size, mixed_shapes, dims, 3, timeout=180):
        for got, want in zip(rank_result, expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def _nan_on_one_rank(mixed) -> tuple[bool, bool, int]:
    torch.manual_seed(0)
    model = mixed()
    fully_shard(model, mesh=ParallelDims(dp_shard=2).build("cpu").dense)
    params = list(model.parameters())
    before = [p.full_tensor().clone() for p in params]
    opt = Muon(params, lr=0.05)
    for p, g in zip(params, mixed().random_grads(0), strict=True):
        p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
    if dist.get_rank() == 1:
        params[0].grad.to_local()[0, 0] = float("nan")  # only rank 1's shard is poisoned
    with pytest.warns(RuntimeWarning, match="NaN or inf"):
        opt.step()
    after = [p.full_tensor() for p in params]
    return (
        torch.equal(after[0], before[0]),
        all(not torch.equal(a, b) for a, b in zip(after[1:], before[1:], strict=True)),
        sum(opt.skipped_steps.values()),
    )


def test_nan_in_one_shard_skips_that_parameter_on_every_rank(mixed_shapes):
    """A NaN in one rank's shard skips the parameter everywhere; the others still update."""
    results = launch(_nan_on_one_rank, 2, mixed_shapes, timeout=120)
    assert results == [(True, True, 1), (True, True, 1)]
