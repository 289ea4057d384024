"""Streams and events for asynchronous copies, with one interface on CPU, CUDA and Ascend NPU.

On an accelerator these are the device module's own ``Stream`` / ``Event`` (``torch.cuda`` or
``torch.npu``), so copies issued on a side stream overlap with compute on the current stream.
The CPU has no streams: work runs synchronously in the caller, so by the time a call returns its
result is complete. :class:`CpuStream` and :class:`CpuEvent` model exactly that, which lets
overlap code (prefetch, swap-to-host) run unchanged on a CPU-only machine and in tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import ModuleType

import torch

from npu_core.device import Backend, detect_backend, device_module


class CpuEvent:
    """Stand-in for a device event on the CPU; always complete once recorded.

    It records the wall clock at :meth:`record` so :meth:`elapsed_time` can time CPU work with
    the same code that times device work.
    """

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        """Mark this point in time; ``stream`` is accepted for interface parity and ignored."""
        self._time = time.perf_counter()

    def wait(self, stream: CpuStream | None = None) -> None:
        """No-op: everything before :meth:`record` already ran in the caller."""

    def query(self) -> bool:
        """Always True: CPU work is complete when the call that issued it returns."""
        return True

    def synchronize(self) -> None:
        """No-op, for the same reason :meth:`query` is always True."""

    def elapsed_time(self, end: CpuEvent) -> float:
        """Milliseconds from this event's record to ``end``'s record, like ``torch.cuda.Event``."""
        if self._time is None or end._time is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._time - self._time) * 1000.0


class CpuStream:
    """Stand-in for a device stream on the CPU: every operation completes before it returns."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other: CpuStream) -> None:
        """No-op: ``other`` has no pending work on the CPU."""

    def wait_event(self, event: CpuEvent) -> None:
        """No-op: a recorded CPU event is already complete."""

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        """Record ``event`` (a new one when None) at the current point and return it."""
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """No-op: there is never pending work."""

    def query(self) -> bool:
        """Always True: there is never pending work."""
        return True

    def __repr__(self) -> str:
        return "CpuStream()"


Stream = torch.Stream | CpuStream
"""Any stream this module hands out: a device stream (``torch.cuda.Stream`` is a subclass)."""
Event = torch.Event | CpuEvent
"""Any event this module hands out."""

# Work on the CPU is always "on" this stream; one instance keeps current_stream() stable.
_CPU_STREAM = CpuStream()


def _resolve(device: torch.device | str | None) -> tuple[torch.device, ModuleType | None]:
    """The concrete device (with an index on accelerators) and its device module (None on CPU)."""
    if device is None:
        backend = detect_backend()
        dev = torch.device(backend.value)
    else:
        dev = torch.device(device)
        try:
            backend = Backend(dev.type)
        except ValueError:
            raise ValueError(f"unsupported device {dev}; use cpu, cuda or npu") from None
    module = device_module(backend)
    if module is None:
        return torch.device("cpu"), None
    if dev.index is None:
        dev = torch.device(dev.type, module.current_device())
    return dev, module


def new_stream(device: torch.device | str | None = None) -> Stream:
    """A new side stream on ``device`` (default: the detected backend's current device)."""
    dev, module = _resolve(device)
    if module is None:
        return CpuStream()
    stream: torch.Stream = module.Stream(device=dev)
    return stream


def current_stream(device: torch.device | str | None = None) -> Stream:
    """The stream that work issued now goes to on ``device``."""
    dev, module = _resolve(device)
    if module is None:
        return _CPU_STREAM
    stream: torch.Stream = module.current_stream(dev)
    return stream


@contextlib.contextmanager
def use_stream(stream: Stream) -> Iterator[Stream]:
    """Make ``stream`` current for the block (and its device current); no-op for a CpuStream."""
    if isinstance(stream, CpuStream):
        yield stream
        return
    _, module = _resolve(stream.device)
    assert module is not None  # a device stream always has a device module
    with module.stream(stream):
        yield stream


def new_event(device: torch.device | str | None = None, enable_timing: bool = False) -> Event:
    """A new event for streams on ``device``; ``enable_timing`` allows ``elapsed_time``."""
    _, module = _resolve(device)
    if module is None:
        return CpuEvent(enable_timing=enable_timing)
    event: torch.Event = module.Event(enable_timing=enable_timing)
    return event


def wait_event(stream: Stream, event: Event) -> None:
    """Make work issued to ``stream`` from now on wait until ``event`` has completed.

    One call for every pairing this module hands out, so callers need not know which side is a
    CPU stand-in: a device stream waits on the device (the host does not block); a
    :class:`CpuEvent` is complete once recorded, so nothing waits; a :class:`CpuStream` runs work
    in the caller at once, so waiting for a device event means blocking the host until it
    completes.
    """
    if isinstance(event, CpuEvent):
        return
    if isinstance(stream, CpuStream):
        event.synchronize()
        return
    stream.wait_event(event)


def copy_async(src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> Event:
    """Copy ``src`` into ``dst`` on ``stream`` and return an event recorded after the copy.

    The side stream first waits for the current stream, because that is where ``src`` was
    produced (and where ``dst`` may still be read). Device tensors are marked as used by
    ``stream`` so the caching allocator does not hand their memory to someone else while the
    copy is still in flight, even if the caller drops its references.

    Until the event completes the caller must not read ``dst`` nor overwrite ``src``. Wait with
    ``current_stream().wait_event(event)`` to order device work after the copy, or
    ``event.synchronize()`` before reading ``dst`` on the host. On the CPU the copy is done
    synchronously and the returned event is already complete.
    """
    if isinstance(stream, CpuStream):
        dst.copy_(src)
        return stream.record_event()
    producer = current_stream(stream.device)
    assert not isinstance(producer, CpuStream)  # a device stream's device has device streams
    stream.wait_stream(producer)
    with use_stream(stream):
        dst.copy_(src, non_blocking=True)
    for tensor in (src, dst):
        if tensor.device.type == stream.device.type:
            tensor.record_stream(stream)
    return stream.record_event()
