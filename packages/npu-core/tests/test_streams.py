"""npu_core.streams: the CPU stand-in and, where a GPU is present, real side-stream copies."""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch

from npu_core import streams
from npu_core.streams import CpuEvent, CpuStream
from npu_core.testing import requires_cuda


def test_cpu_device_gives_cpu_stand_ins():
    """On the cpu the factories return the synchronous stand-ins; the current stream is stable."""
    assert isinstance(streams.new_stream("cpu"), CpuStream)
    assert isinstance(streams.new_event("cpu"), CpuEvent)
    assert streams.current_stream("cpu") is streams.current_stream("cpu")
    assert streams.new_stream("cpu").device == torch.device("cpu")


def test_cpu_stream_methods_report_completion():
    """Stand-in streams and events are always complete; record_event returns the event given."""
    stream, other = CpuStream(), CpuStream()
    stream.wait_stream(other)
    event = stream.record_event()
    stream.wait_event(event)
    event.wait(stream)
    event.synchronize()
    stream.synchronize()
    assert stream.query()
    assert event.query()
    mine = CpuEvent()
    assert stream.record_event(mine) is mine


def test_cpu_event_elapsed_time_measures_wall_clock_in_ms():
    """elapsed_time is the wall-clock gap between records, in milliseconds, and signed."""
    start, end = CpuEvent(enable_timing=True), CpuEvent(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    elapsed = start.elapsed_time(end)
    assert 15.0 <= elapsed < 1000.0
    assert end.elapsed_time(start) == pytest.approx(-elapsed)


def test_cpu_event_elapsed_time_requires_records():
    """Timing an unrecorded event is an error, not a silent zero."""
    with pytest.raises(RuntimeError, match="recorded"):
        CpuEvent().elapsed_time(CpuEvent())


def test_use_stream_is_a_no_op_for_cpu_stream():
    """The context manager yields the stand-in and leaves the current stream unchanged."""
    stream = streams.new_stream("cpu")
    with streams.use_stream(stream) as active:
        assert active is stream
        assert streams.current_stream("cpu") is not stream


def test_copy_async_on_cpu_copies_and_returns_complete_event():
    """The copy is done when copy_async returns, including dtype conversion like copy_."""
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.empty(1000, dtype=torch.float64)
    event = streams.copy_async(src, dst, streams.new_stream("cpu"))
    assert isinstance(event, CpuEvent)
    assert event.query()
    assert torch.equal(dst, src.double())


def test_unsupported_device_is_rejected():
    """A device type npu_core does not manage gives a clear error."""
    with pytest.raises(ValueError, match="unsupported device meta"):
        streams.new_stream("meta")


@requires_cuda
def test_cuda_side_stream_is_a_real_distinct_stream():
    """On a GPU the factories return torch.cuda streams and use_stream switches the current one."""
    stream = streams.new_stream("cuda")
    assert isinstance(stream, torch.cuda.Stream)
    assert stream != streams.current_stream("cuda")
    with streams.use_stream(stream):
        assert streams.current_stream("cuda") == stream
    assert isinstance(streams.new_event("cuda", enable_timing=True), torch.cuda.Event)


@requires_cuda
def test_copy_async_cuda_round_trip_through_pinned_host():
    """H2D then D2H on a side stream, each after work queued on the current stream, is exact."""
    stream = streams.new_stream("cuda")
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    device_buf = torch.empty_like(host, device="cuda")
    # Queue work on the current stream that produces the copy's source; the copy must wait.
    produced = torch.ones(1 << 20, device="cuda").cumsum(0)
    streams.current_stream("cuda").wait_event(streams.copy_async(produced, device_buf, stream))
    back = torch.empty_like(host).pin_memory()
    streams.copy_async(device_buf, back, stream).synchronize()
    assert torch.equal(back, produced.cpu())
    streams.copy_async(host, device_buf, stream).synchronize()
    assert torch.equal(device_buf.cpu(), host)


def test_wait_event_on_cpu_stand_ins_returns_at_once():
    """A CPU stream waiting on a CPU event: the event is complete once recorded, nothing waits."""
    stream = CpuStream()
    event = stream.record_event()
    began = time.perf_counter()
    streams.wait_event(stream, event)
    streams.wait_event(streams.current_stream("cpu"), CpuEvent())  # never recorded: still done
    assert time.perf_counter() - began < 0.5


def test_wait_event_dispatches_on_stream_and_event_kind():
    """A CPU stream blocks the host on a device event; a device stream waits on the device for a
    device event and not at all for a CPU event (that work is already done)."""
    # Stand-ins that pass as a torch.Event / torch.Stream (not the CPU ones) and record the
    # calls, so the device branches run without an accelerator.
    device_event = mock.Mock(spec=torch.Event)
    streams.wait_event(CpuStream(), device_event)
    device_event.synchronize.assert_called_once_with()
    device_stream = mock.Mock(spec=torch.Stream)
    streams.wait_event(device_stream, device_event)
    device_stream.wait_event.assert_called_once_with(device_event)
    device_event.synchronize.assert_called_once_with()  # the host did not block this time
    streams.wait_event(device_stream, CpuEvent())
    device_stream.wait_event.assert_called_once_with(device_event)


@requires_cuda
def test_wait_event_orders_current_stream_after_side_stream_copy():
    """The current stream reads a buffer only after the side stream's copy into it finished."""
    stream = streams.new_stream("cuda")
    source = torch.ones(1 << 22, device="cuda").cumsum(0)
    target = torch.empty_like(source)
    streams.wait_event(streams.current_stream("cuda"), streams.copy_async(source, target, stream))
    assert torch.equal(target.sum(), source.sum())
