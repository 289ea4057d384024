"""mccl on real gloo ranks: correctness, blocking at first use, failures and timeouts."""

from __future__ import annotations

import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import mccl
from npu_core.dist import launch


def _collectives_after_async_init() -> dict:
    handle = mccl.init_process_group("gloo")
    assert handle.is_async
    rank, world = dist.get_rank(), dist.get_world_size()
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    value = torch.tensor([42.0 if rank == 0 else 0.0])
    dist.broadcast(value, src=0)
    dist.barrier()
    gates_left = [
        name
        for name, module in sys.modules.items()
        if name.startswith("torch.distributed")
        for attr in ("is_initialized", "_get_default_group")
        if getattr(getattr(module, attr, None), "__mccl_gate__", False)
    ]
    return {
        "rank": rank,
        "world": world,
        "sum": summed.item(),
        "gathered": [g.tolist() for g in gathered],
        "broadcast": value.item(),
        "ready": mccl.is_ready() and handle.done(),
        "gates_left": gates_left,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_correct_after_async_init(world_size):
    """all_reduce, all_gather, broadcast and barrier give the stock results; gates are removed."""
    results = launch(_collectives_after_async_init, world_size, backend=None, timeout=120)
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world"] == world_size
        assert result["sum"] == world_size * (world_size + 1) / 2
        assert result["gathered"] == [[float(r)] * 2 for r in range(world_size)]
        assert result["broadcast"] == 42.0
        assert result["ready"]
        assert result["gates_left"] == []


LATE_S = 1.5


def _collective_before_ready() -> dict:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(LATE_S)  # rank 1 is slow to arrive: rank 0's init cannot have finished
    start = time.monotonic()
    handle = mccl.init_process_group("gloo")
    returned_in = time.monotonic() - start
    done_at_return = handle.done()
    ready_at_return = mccl.is_ready()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # issued before init completes on rank 0: must block, then succeed
    return {
        "returned_in": returned_in,
        "done_at_return": done_at_return,
        "ready_at_return": ready_at_return,
        "waited": time.monotonic() - start,
        "sum": t.item(),
    }


@pytest.mark.distributed
def test_collective_before_ready_blocks_then_succeeds():
    """init returns at once; the first all_reduce waits for the late rank and is correct."""
    first, second = launch(_collective_before_ready, 2, backend=None, timeout=120)
    assert first["returned_in"] < 0.5
    assert not first["done_at_return"] and not first["ready_at_return"]
    assert first["waited"] > LATE_S * 0.7
    assert first["sum"] == second["sum"] == 3.0


def _init_with_absent_rank(absent: int, init_timeout: float) -> dict | None:
    if int(os.environ["RANK"]) == absent:
        return None
    start = time.monotonic()
    handle = mccl.init_process_group("gloo", init_timeout=init_timeout)
    # The last listing before the timeout: a loaded machine can start the other present rank
    # late, so an early listing may still count it among the absent.
    waiting = None
    while not handle.done():
        waiting = handle.waiting_for() or waiting
        time.sleep(0.05)
    try:
        dist.get_world_size()
    except mccl.InitTimeoutError as exc:
        time.sleep(1.0)  # rank 0 hosts the store: keep it up while the other rank reads it
        return {
            "missing": exc.missing_ranks,
            "message": str(exc),
            "after": time.monotonic() - start,
            "waiting": waiting,
            "waiting_after": handle.waiting_for(),
        }
    return {"missing": None}


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "absent"), [(3, 2), (2, 0)])
def test_absent_rank_gives_timeout_error_naming_it(world_size, absent):
    """A rank that never arrives is named in InitTimeoutError within init_timeout, no hang;
    while the others wait, the handle says what for (the store, or how many ranks)."""
    init_timeout = 4.0
    results = launch(
        _init_with_absent_rank, world_size, absent, init_timeout, backend=None, timeout=60
    )
    for rank, result in enumerate(results):
        if rank == absent:
            continue
        assert result["missing"] == [absent]
        assert f"{absent}" in result["message"] and "127.0.0.1:" in result["message"]
        assert result["after"] < init_timeout + 5.0
        expected = "the rendezvous store at 127.0.0.1:" if absent == 0 else "1 more rank at "
        assert result["waiting"].startswith(expected), result["waiting"]
        assert result["waiting_after"] is None


def _failing_init(backend: str) -> dict:
    mccl.init_process_group(backend, init_timeout=30)
    try:
        dist.get_rank()
    except Exception as exc:
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        return {"type": type(exc).__name__, "message": str(exc), "frames": frames}
    return {"type": None}


@pytest.mark.distributed
def test_background_failure_is_reraised_at_first_use():
    """An exception in the init thread surfaces in the main thread with the worker's frames.

    MPI is a backend torch knows (so the call accepts it) but this torch build lacks, so process
    group creation fails on the background thread.
    """
    if dist.is_mpi_available():
        pytest.skip("this torch build has MPI; the test needs a known but unbuilt backend")
    (result,) = launch(_failing_init, 1, "mpi", backend=None, timeout=60)
    assert result["type"] is not None, "first use must raise"
    assert "mpi" in result["message"].lower()
    assert "_run" in result["frames"], "the original (worker) traceback must be kept"


def _groups_before_ready() -> dict:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(LATE_S)
    mccl.init_process_group("gloo")
    queued_pair = mccl.new_group([0, 1])
    queued_all = mccl.new_group(None)
    pair_done_early = queued_pair.done()
    blocking = dist.new_group([1, 2])  # the stock call before readiness: blocks, then works
    pair = torch.tensor([1.0])
    dist.all_reduce(pair, group=queued_pair.wait(timeout=60))
    everyone = torch.tensor([1.0])
    dist.all_reduce(everyone, group=queued_all.wait(timeout=60))
    tail = torch.tensor([1.0])
    if rank in (1, 2):
        dist.all_reduce(tail, group=blocking)
    return {
        "pair_done_early": pair_done_early,
        "pair": pair.item() if rank in (0, 1) else None,
        "all": everyone.item(),
        "tail": tail.item(),
    }


@pytest.mark.distributed
def test_new_group_before_ready_is_created_in_order():
    """Sub-groups requested before init completes are created, in order, once it has."""
    results = launch(_groups_before_ready, 3, backend=None, timeout=120)
    assert not results[0]["pair_done_early"]
    assert [r["pair"] for r in results] == [2.0, 2.0, None]
    assert [r["all"] for r in results] == [3.0, 3.0, 3.0]
    assert [r["tail"] for r in results] == [1.0, 2.0, 2.0]


def _device_mesh_before_ready() -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    mccl.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh.get_group())
    return [t.item(), mesh.size()]


@pytest.mark.distributed
def test_device_mesh_waits_for_async_init():
    """DeviceMesh (and so FSDP2) built right after async init waits and works."""
    assert launch(_device_mesh_before_ready, 2, backend=None, timeout=120) == [[1.0, 2], [1.0, 2]]


def _sync_fallback(use_env: bool) -> tuple[bool, float]:
    if use_env:
        os.environ["MCCL_ASYNC_INIT"] = "0"
        handle = mccl.init_process_group("gloo")
    else:
        handle = mccl.init_process_group("gloo", async_init=False)
    assert dist.is_initialized() and handle.done()  # stock path: ready on return
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return handle.is_async, t.item()


@pytest.mark.distributed
@pytest.mark.parametrize("use_env", [False, True])
def test_sync_fallback_is_stock_blocking_path(use_env):
    """async_init=False or MCCL_ASYNC_INIT=0 initialises before returning."""
    assert launch(_sync_fallback, 2, use_env, backend=None, timeout=120) == [(False, 2.0)] * 2
