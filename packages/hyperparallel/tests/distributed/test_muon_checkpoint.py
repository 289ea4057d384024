"""Muon state through torch.distributed.checkpoint: same world size bit-exact, smaller correct."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from hyperparallel.models.parallelize import build_mesh
from hyperparallel.optim import Muon
from npu_core.dist import launch

pytestmark = pytest.mark.distributed


class Mixed(nn.Module):
    """Mixed shapes: uneven rows (5 and 3 on 4 ranks leave empty shards), experts, a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 16, bias=False)
        self.b = nn.Linear(16, 5, bias=False)
        self.c = nn.Linear(5, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 6, 5))
        self.conv = nn.Conv2d(2, 6, 3, bias=False)


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def _setup(seed: int):
    torch.manual_seed(seed)
    model = Mixed()
    fully_shard(model, mesh=build_mesh((dist.get_world_size(),), "cpu"))
    return model, Muon(model.parameters(), lr=0.05)


def _step(model, opt, step: int) -> None:
    for p, g in zip(model.parameters(), _grads(Mixed(), step), strict=True):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
    opt.step()


def _train_save_continue(path: str) -> list[list[float]]:
    model, opt = _setup(seed=0)
    for step in range(2):
        _step(model, opt, step)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    _step(model, opt, 2)
    return [p.full_tensor().tolist() for p in model.parameters()]


def _load_continue(path: str) -> list[list[float]]:
    model, opt = _setup(seed=123)  # different weights: everything must come from the checkpoint
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _step(model, opt, 2)
    return [p.full_tensor().tolist() for p in model.parameters()]


def test_resume_same_world_bit_exact_and_smaller_world_correct(tmp_path):
    """Saved at world 4: resuming at 4 repeats the next step exactly; at 2 within fp32 noise."""
    path = str(tmp_path / "ckpt")
    expected = launch(_train_save_continue, 4, path, timeout=180)[0]
    same = launch(_load_continue, 4, path, timeout=180)[0]
    assert same == expected
    smaller = launch(_load_continue, 2, path, timeout=180)[0]
    for got, want in zip(smaller, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
