"""mccl with NCCL on GPUs: init returns at once, the first collective waits and is correct.

NCCL needs one GPU per rank: world 1 (a real NCCL process group and communicator) runs on any
CUDA machine, larger worlds only with that many GPUs. Ranks are spawned so they can import this
file whatever an earlier test did with the launcher's fork server.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import mccl
from npu_core.dist import launch
from npu_core.testing import requires_cuda

pytestmark = [pytest.mark.device, pytest.mark.distributed, requires_cuda]

# Device work issued while the group starts: a few large GEMMs, like a model build and warm-up.
WARMUP_MATMULS = 8
# With two ranks or more, the last one arrives this late: the others' first collective must wait.
LATE_S = 1.5


def _nccl_after_async_init(late_s: float) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world > 1 and rank == world - 1:
        time.sleep(late_s)
    start = time.perf_counter()
    handle = mccl.init_process_group("nccl")
    returned_ms = 1000 * (time.perf_counter() - start)
    done_at_return = handle.done()
    overlap_start = time.perf_counter()
    a = torch.randn(4096, 4096, device=device)
    for _ in range(WARMUP_MATMULS):
        a = (a @ a).tanh_()
    torch.cuda.synchronize(device)
    device_work_ms = 1000 * (time.perf_counter() - overlap_start)

    collective_start = time.perf_counter()
    joined = dist.get_world_size()  # first use: blocks until the group exists
    summed = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    gathered = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=device))
    value = torch.tensor([42.0 if rank == 0 else 0.0], device=device)
    dist.broadcast(value, src=0)
    torch.cuda.synchronize(device)
    first_collective_ms = 1000 * (time.perf_counter() - collective_start)
    waited_ms = 1000 * (time.perf_counter() - start)
    gates_left = [
        name
        for name, module in sys.modules.items()
        if name.startswith("torch.distributed")
        for attr in ("is_initialized", "_get_default_group")
        if getattr(getattr(module, attr, None), "__mccl_gate__", False)
    ]
    elapsed = handle.elapsed()
    result = {
        "rank": dist.get_rank(),
        "world": joined,
        "backend": str(dist.get_backend()),
        "sum": summed.cpu().tolist(),
        "gathered": [g.cpu().tolist() for g in gathered],
        "broadcast": value.item(),
        "on_device": summed.device.type,
        "ready": mccl.is_ready() and handle.done(),
        "gates_left": gates_left,
        "returned_ms": returned_ms,
        "done_at_return": done_at_return,
        "waited_ms": waited_ms,
        "init_ms": None if elapsed is None else 1000 * elapsed,
        "device_work_ms": device_work_ms,
        "first_collective_ms": first_collective_ms,
    }
    dist.destroy_process_group()  # the launcher only tears down groups it created itself
    return result


@pytest.mark.parametrize("world", [1, 2])
def test_nccl_async_init_first_collective_waits_and_is_correct(world, record_property):
    """all_reduce, all_gather and broadcast on CUDA tensors give the stock results after an
    asynchronous NCCL init that overlapped device work; with a late rank, the others' first
    collective waits for it; the gates are gone afterwards."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs one GPU per rank: world {world}, {torch.cuda.device_count()} GPU")
    results = launch(
        _nccl_after_async_init, world, LATE_S, backend=None, start_method="spawn", timeout=240
    )
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world"] == world
        assert result["backend"] == "nccl" and result["on_device"] == "cuda"
        assert result["sum"] == [world * (world + 1) / 2] * 3
        assert result["gathered"] == [[float(r)] * 2 for r in range(world)]
        assert result["broadcast"] == 42.0
        assert result["ready"] and result["gates_left"] == []
        assert result["returned_ms"] < 500, "init_process_group blocked instead of returning"
    if world > 1:
        first = results[0]
        assert not first["done_at_return"], "rank 0 finished init before the late rank arrived"
        assert first["waited_ms"] > 0.7 * LATE_S * 1000, first
    numbers = {
        "world": world,
        "init_returned_ms": round(max(r["returned_ms"] for r in results), 3),
        "background_init_ms": round(max(r["init_ms"] or 0.0 for r in results), 3),
        "device_work_ms": round(max(r["device_work_ms"] for r in results), 3),
        "first_collectives_ms": round(max(r["first_collective_ms"] for r in results), 3),
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"mccl nccl: {numbers}")
