"""Muon on FSDP2 over NCCL (CUDA) gives the update gloo gives on the CPU, at the same world size.

NCCL needs one GPU per rank: world 1 (a real NCCL process group, the distributed engine's
collectives included) runs on any CUDA machine, larger worlds only with that many GPUs. Ranks are
spawned (not forked from a server started by an earlier test) so they can import this file.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from hyperparallel.optim import Muon
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.dist import launch
from npu_core.testing import requires_cuda

pytestmark = [pytest.mark.device, pytest.mark.distributed, requires_cuda]

STEPS = 3
TIMED_STEPS = 5
# Relative Frobenius error of each parameter's total update, NCCL/cuda vs gloo/cpu. fp32: both
# sides run IEEE fp32 GEMMs, only summation order differs. bf16: Newton-Schulz rounds to bf16 on
# both sides, but cuBLAS and the CPU accumulate bf16 products in different orders.
UPDATE_RTOL = {"fp32": 1e-4, "bf16": 5e-2}


class _Mixed(nn.Module):
    """Uneven rows (5 rows on 2 ranks), experts [E, M, N], a conv and one 1024 x 512 matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 96, bias=False)
        self.b = nn.Linear(96, 5, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 24, 16) / 4)
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.big = nn.Linear(512, 1024, bias=False)


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def _initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in _Mixed().parameters()]


def _single_process(ns_dtype: str) -> list[torch.Tensor]:
    """Plain (unsharded) Muon on the CPU: no process group at all."""
    torch.manual_seed(0)
    model = _Mixed()
    opt = Muon(model.parameters(), lr=0.05, ns_dtype=ns_dtype)
    for step in range(STEPS):
        for p, g in zip(model.parameters(), _grads(model, step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sharded(device_type: str, ns_dtype: str) -> dict:
    """One rank: FSDP2-sharded Muon for STEPS steps, then TIMED_STEPS timed ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        # TF32 off: the fp32 comparison is IEEE fp32 against IEEE fp32.
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    reference = _Mixed()
    model = copy.deepcopy(reference).to(device)
    fully_shard(model, mesh=ParallelDims(dp_shard=world).build(device_type).dense)
    opt = Muon(model.parameters(), lr=0.05, ns_dtype=ns_dtype)

    def step(index: int) -> None:
        for p, g in zip(model.parameters(), _grads(reference, index), strict=True):
            p.grad = distribute_tensor(g.to(device), p.device_mesh, p.placements)
        opt.step()

    for index in range(STEPS):
        step(index)
    # clone: on one rank full_tensor() may be the local shard itself, which the timed steps
    # below would keep changing
    params = [p.full_tensor().detach().cpu().clone() for p in model.parameters()]
    samples = []
    for index in range(STEPS, STEPS + TIMED_STEPS):
        if device_type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step(index)
        if device_type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return {
        "backend": str(dist.get_backend()),
        "params": params,
        "step_ms": 1000 * sorted(samples)[len(samples) // 2],
    }


def _relative_update_error(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor) -> float:
    want_update = want - init
    return float((got - want).norm() / want_update.norm())


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_muon_update_on_nccl_equals_gloo(world, ns_dtype, record_property):
    """FSDP2 Muon over NCCL on GPUs equals FSDP2 Muon over gloo on the CPU and plain Muon."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank: world {world}, {torch.cuda.device_count()} GPU")
    gloo = launch(
        _sharded, world, "cpu", ns_dtype, backend="gloo", start_method="spawn", timeout=240
    )
    nccl = launch(
        _sharded, world, "cuda", ns_dtype, backend="nccl", start_method="spawn", timeout=240
    )
    assert [r["backend"] for r in nccl] == ["nccl"] * world
    assert [r["backend"] for r in gloo] == ["gloo"] * world
    init, single = _initial(), _single_process(ns_dtype)
    names = [name for name, _ in _Mixed().named_parameters()]
    worst = 0.0
    for rank_result in nccl:
        for name, got, want, plain, start in zip(
            names, rank_result["params"], gloo[0]["params"], single, init, strict=True
        ):
            assert not torch.equal(got, start), f"{name} did not move"
            error = _relative_update_error(got, want, start)
            worst = max(worst, error)
            assert error < UPDATE_RTOL[ns_dtype], f"{name}: nccl vs gloo update error {error:.2e}"
            plain_error = _relative_update_error(got, plain, start)
            assert plain_error < UPDATE_RTOL[ns_dtype], (
                f"{name}: nccl vs single-process update error {plain_error:.2e}"
            )
    numbers = {
        "world": world,
        "ns_dtype": ns_dtype,
        "worst_update_rel_error": f"{worst:.2e}",
        "nccl_step_ms": round(max(r["step_ms"] for r in nccl), 3),
        "gloo_cpu_step_ms": round(max(r["step_ms"] for r in gloo), 3),
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"muon nccl vs gloo: {numbers}")
