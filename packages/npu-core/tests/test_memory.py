"""npu_core.memory: pinned host buffers, the buffer pool and memory statistics."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from npu_core import memory
from npu_core.device import Backend, detect_backend
from npu_core.testing import requires_cuda


def test_pinned_empty_pins_only_with_an_accelerator():
    """pin=None pins exactly when an accelerator is detected; pin=False never pins."""
    tensor = memory.pinned_empty((3, 4), torch.float16)
    assert tensor.shape == (3, 4)
    assert tensor.dtype == torch.float16
    assert tensor.is_pinned() == (detect_backend() is not Backend.CPU)
    assert not memory.pinned_empty(5, torch.int8, pin=False).is_pinned()


def test_pool_reuses_storage_after_release():
    """A released buffer is handed out again for the same numel and dtype, whatever the shape."""
    pool = memory.HostBufferPool(pin=False)
    first = pool.acquire((4, 6), torch.float32)
    ptr = first.data_ptr()
    pool.release(first)
    again = pool.acquire((24,), torch.float32)
    assert again.data_ptr() == ptr
    assert again.shape == (24,)
    assert pool.nbytes == 24 * 4


def test_pool_never_hands_out_a_buffer_twice():
    """Buffers held by callers are distinct; a different dtype gets its own buffer."""
    pool = memory.HostBufferPool(pin=False)
    held = [pool.acquire(16, torch.float32) for _ in range(3)]
    other = pool.acquire(16, torch.int32)
    ptrs = {t.data_ptr() for t in [*held, other]}
    assert len(ptrs) == 4
    assert pool.nbytes == 4 * 16 * 4


def test_pool_rejects_double_and_foreign_release():
    """Releasing twice, or a tensor the pool never gave out, would let two owners share memory."""
    pool = memory.HostBufferPool(pin=False)
    buffer = pool.acquire(8, torch.float32)
    pool.release(buffer)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(buffer)
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(torch.empty(8))


def test_pool_clear_drops_free_buffers_but_tracks_held_ones():
    """clear() frees idle memory; a buffer still held can be released afterwards and reused."""
    pool = memory.HostBufferPool(pin=False)
    idle = pool.acquire(100, torch.float64)
    held = pool.acquire(10, torch.float64)
    pool.release(idle)
    pool.clear()
    assert pool.nbytes == 10 * 8
    ptr = held.data_ptr()
    pool.release(held)
    assert pool.acquire(10, torch.float64).data_ptr() == ptr


def test_pool_is_thread_safe():
    """Concurrent acquire/release never gives one buffer to two threads at once."""
    pool = memory.HostBufferPool(pin=False)
    errors: list[str] = []
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()

    def worker(ident: int) -> None:
        for _ in range(200):
            buffer = pool.acquire(64, torch.uint8)
            with owners_lock:
                if buffer.data_ptr() in owners:
                    errors.append(f"{buffer.data_ptr()} held by {owners[buffer.data_ptr()]}")
                owners[buffer.data_ptr()] = ident
            with owners_lock:
                del owners[buffer.data_ptr()]
            pool.release(buffer)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert pool.nbytes <= 4 * 64


def test_memory_stats_on_cpu_track_rss():
    """On cpu, allocated follows RSS: touching 200 MB raises it, and the peak covers it."""
    before = memory.memory_stats("cpu")
    assert before.backend is Backend.CPU
    big = torch.ones(200 * 2**20, dtype=torch.uint8)  # ones() touches every page
    after = memory.memory_stats("cpu")
    assert after.allocated_bytes - before.allocated_bytes > 150 * 2**20
    assert after.reserved_bytes == after.allocated_bytes
    assert after.peak_allocated_bytes >= after.allocated_bytes
    assert after.host_rss_bytes == pytest.approx(after.allocated_bytes, rel=0.05)
    del big


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux procfs")
def test_cpu_peak_resets_on_linux():
    """After freeing a big tensor, reset brings the cpu peak back near the current RSS."""
    big = torch.ones(300 * 2**20, dtype=torch.uint8)
    del big
    high = memory.memory_stats("cpu").peak_allocated_bytes
    memory.reset_peak_memory_stats("cpu")
    low = memory.memory_stats("cpu")
    assert low.peak_allocated_bytes < high - 200 * 2**20
    assert low.peak_allocated_bytes >= low.allocated_bytes * 0.9


def test_memory_stats_is_frozen():
    """A snapshot cannot be edited after the fact."""
    stats = memory.memory_stats("cpu")
    with pytest.raises(AttributeError):
        stats.allocated_bytes = 0  # type: ignore[misc]


@requires_cuda
def test_memory_stats_on_cuda_follow_the_allocator():
    """Allocating 64 MiB on the GPU raises allocated and peak; reset brings peak back down."""
    memory.reset_peak_memory_stats("cuda")
    before = memory.memory_stats("cuda")
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    after = memory.memory_stats("cuda")
    assert after.backend is Backend.CUDA
    assert after.allocated_bytes - before.allocated_bytes >= 64 * 2**20
    assert after.reserved_bytes >= after.allocated_bytes
    assert after.peak_allocated_bytes >= after.allocated_bytes
    del block
    memory.reset_peak_memory_stats("cuda")
    assert memory.memory_stats("cuda").peak_allocated_bytes < after.peak_allocated_bytes
