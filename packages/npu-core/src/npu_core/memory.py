"""Pinned host buffers and memory statistics for CPU, CUDA and Ascend NPU.

Page-locked (pinned) host memory is what makes host<->device copies truly asynchronous, but
pinning is slow and only possible when an accelerator runtime is present. :func:`pinned_empty`
pins only where that is possible and useful, and :class:`HostBufferPool` pays the pinning cost
once per buffer shape instead of once per copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys
import threading
from collections import defaultdict
from collections.abc import Sequence

import torch

from npu_core.device import Backend, detect_backend, device_module

Shape = int | Sequence[int]


def pinned_empty(shape: Shape, dtype: torch.dtype, *, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when an accelerator is present.

    Args:
        shape: Tensor shape.
        dtype: Element type.
        pin: True to pin, False not to, None to pin exactly when :func:`detect_backend` finds an
            accelerator. On a CPU-only machine pinning raises inside torch, and would buy nothing.
    """
    if pin is None:
        pin = detect_backend() is not Backend.CPU
    return torch.empty(_as_tuple(shape), dtype=dtype, pin_memory=pin)


def _as_tuple(shape: Shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


class HostBufferPool:
    """Reuses host buffers keyed by (number of elements, dtype); thread-safe.

    Swap-to-host code acquires a buffer per tensor it offloads, often from autograd hooks on
    several threads, and releases it when the tensor is brought back. Reuse avoids re-pinning,
    which costs far more than the copy itself. Reused buffers are not cleared: callers overwrite
    them. Zero-element requests are served with fresh tensors and not tracked.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        """Create an empty pool; ``pin`` is passed to :func:`pinned_empty` for new buffers."""
        self._pin = pin
        self._lock = threading.Lock()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        # data_ptr -> base buffer handed out; release() finds the buffer again from a view of it.
        self._in_use: dict[int, torch.Tensor] = {}
        self._nbytes = 0

    def acquire(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` that no other caller holds until it is released."""
        shape = _as_tuple(shape)
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        key = (numel, dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self._in_use[buffer.data_ptr()] = buffer
                return buffer.view(shape)
        # Allocate outside the lock: pinning can take milliseconds.
        buffer = pinned_empty(numel, dtype, pin=self._pin)
        with self._lock:
            self._nbytes += buffer.nbytes
            self._in_use[buffer.data_ptr()] = buffer
        return buffer.view(shape)

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a tensor returned by :meth:`acquire` so it can be handed out again.

        Raises:
            ValueError: ``tensor`` is not currently acquired from this pool (never was, or has
                already been released); accepting it would let two callers share a buffer.
        """
        if tensor.numel() == 0:
            return
        with self._lock:
            buffer = self._in_use.pop(tensor.data_ptr(), None)
            if buffer is None:
                raise ValueError(
                    "release() of a tensor not acquired from this pool, or released twice"
                )
            self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    def clear(self) -> None:
        """Drop the free buffers; buffers still acquired stay tracked until released."""
        with self._lock:
            for buffers in self._free.values():
                self._nbytes -= sum(buffer.nbytes for buffer in buffers)
            self._free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool owns: free buffers plus buffers acquired now."""
        with self._lock:
            return self._nbytes


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """A snapshot of memory use, in bytes.

    On cuda/npu the first three numbers come from the caching allocator of the current device:
    ``allocated_bytes`` is memory held by live tensors, ``reserved_bytes`` what the allocator has
    taken from the driver (allocated plus its cache), ``peak_allocated_bytes`` the most allocated
    since start or the last :func:`reset_peak_memory_stats`.

    On cpu there is no allocator to ask, so ``allocated_bytes`` and ``reserved_bytes`` are both
    the process's resident set size (which also counts code and Python objects), and
    ``peak_allocated_bytes`` is the process's peak RSS since start or, on Linux, since the last
    :func:`reset_peak_memory_stats`.

    ``host_rss_bytes`` is the process's current resident set size on every backend.
    """

    backend: Backend
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    host_rss_bytes: int


def _backend_and_device(device: torch.device | str | None) -> tuple[Backend, torch.device]:
    if device is None:
        backend = detect_backend()
        return backend, torch.device(backend.value)
    dev = torch.device(device)
    try:
        return Backend(dev.type), dev
    except ValueError:
        raise ValueError(f"unsupported device {dev}; use cpu, cuda or npu") from None


def _peak_rss_bytes() -> int:
    try:  # Linux: VmHWM, which clear_refs can reset (ru_maxrss cannot be)
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        # No procfs (macOS): the peak is the closest number the OS offers.
        return _peak_rss_bytes()


def memory_stats(device: torch.device | str | None = None) -> MemoryStats:
    """Memory use of ``device`` (default: the detected backend's current device)."""
    backend, dev = _backend_and_device(device)
    rss = _rss_bytes()
    module = device_module(backend)
    if module is None:
        return MemoryStats(backend, rss, rss, max(_peak_rss_bytes(), rss), rss)
    return MemoryStats(
        backend,
        allocated_bytes=int(module.memory_allocated(dev)),
        reserved_bytes=int(module.memory_reserved(dev)),
        peak_allocated_bytes=int(module.max_memory_allocated(dev)),
        host_rss_bytes=rss,
    )


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    """Restart peak tracking: the device allocator's on cuda/npu, the peak RSS on Linux cpu
    (elsewhere the OS keeps the process's all-time peak)."""
    backend, dev = _backend_and_device(device)
    module = device_module(backend)
    if module is not None:
        module.reset_peak_memory_stats(dev)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # 5: reset the peak resident set size to the current one
