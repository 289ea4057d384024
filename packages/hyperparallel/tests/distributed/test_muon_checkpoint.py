"""Muon state through torch.distributed.checkpoint: same world size bit-exact, smaller correct.

The model is conftest's ``mixed_shapes`` (the one test_fsdp_muon uses)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from hyperparallel.optim import Muon
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch

pytestmark = pytest.mark.distributed


def _setup(mixed, seed: int):
    torch.manual_seed(seed)
    model = mixed()
    fully_shard(model, mesh=ParallelDims(dp_shard=dist.get_world_size()).build("cpu").dense)
    return model, Muon(model.parameters(), lr=0.05)


def _step(model, opt, step: int) -> None:
    for p, g in zip(model.parameters(), model.random_grads(step), strict=True):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    opt.step()


def _train_save_continue(mixed, path: str) -> list[list[float]]:
    model, opt = _setup(mixed, seed=0)
    for step in range(2):
        _step(model, opt, step)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    _step(model, opt, 2)
    return [p.full_tensor().tolist() for p in model.parameters()]


def _load_continue(mixed, path: str) -> list[list[float]]:
    # Different weights: everything must come from the checkpoint.
    model, opt = _setup(mixed, seed=123)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _step(model, opt, 2)
    return [p.full_tensor().tolist() for p in model.parameters()]


def test_resume_same_world_bit_exact_and_smaller_world_correct(tmp_path, mixed_shapes):
    """Saved at world 4: resuming at 4 repeats the next step exactly; at 2 within fp32 noise."""
    path = str(tmp_path / "ckpt")
    expected = launch(_train_save_continue, 4, mixed_shapes, path, timeout=180)[0]
    same = launch(_load_continue, 4, mixed_shapes, path, timeout=180)[0]
    assert same == expected
    smaller = launch(_load_continue, 2, mixed_shapes, path, timeout=180)[0]
    for got, want in zip(smaller, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
