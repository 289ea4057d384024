"""Early recompute through a session, and the swap schedule's offload and prefetch triggers."""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.activation import (
    RecomputeSession,
    SwapSchedule,
    checkpoint_wrapper,
    track_saved_activations,
)
from hyperparallel.activation.region import Region


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))


def _reference(x: torch.Tensor) -> list[torch.Tensor]:
    model = _model()
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_early_recompute_is_reused_by_backward_and_freed():
    """handle.recompute() before backward: backward recomputes nothing more, results freed."""
    x = torch.randn(4, 8)
    model = _model()
    for block in model:
        checkpoint_wrapper(block)
    session = RecomputeSession()
    with session, session.micro_batch(0):
        loss = model(x).square().sum()
    handles = session.handles(0)
    assert [h.recomputes for h in handles] == [0, 0, 0]
    session.recompute(0)
    session.recompute(0)  # a second request finds the results waiting: no second replay
    assert [h.recomputes for h in handles] == [1, 1, 1]
    loss.backward()
    assert [h.recomputes for h in handles] == [1, 1, 1]
    assert all(h.done for h in handles)  # regions (and their early results) are freed
    for got, want in zip((p.grad for p in model.parameters()), _reference(x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_swap_schedule_pairs_offload_with_later_forward_and_prefetches_ahead(monkeypatch):
    """offload_after=1 keeps only the last block's inputs on device; backward prefetches."""
    prefetched = []
    original = Region.prefetch

    def spy(self):
        prefetched.append(self.name)
        original(self)

    monkeypatch.setattr(Region, "prefetch", spy)
    x = torch.randn(4, 8)
    model = _model()
    for block in model:
        checkpoint_wrapper(block, swap_inputs=True)
    input_bytes = 4 * 8 * 4
    with track_saved_activations() as tracker, SwapSchedule(offload_after=1, prefetch_ahead=1):
        loss = model(x).square().sum()
    report = tracker.report()
    # Block 0's input is x (a plain tensor); blocks 1 and 2 take the previous tanh output.
    assert report.host_bytes == 2 * input_bytes
    assert report.device_bytes == 2 * input_bytes  # + the output, saved by square() outside
    loss.backward()
    # Blocks 1 and 0 prefetched from the hooks of blocks 2 and 1, before their own replay.
    assert len(prefetched) == 2
    for got, want in zip((p.grad for p in model.parameters()), _reference(x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_swap_schedule_recompute_ahead_runs_each_region_once():
    """recompute_ahead=1: block k-1 is replayed when backward reaches block k; never twice."""
    x = torch.randn(4, 8)
    model = _model()
    for block in model:
        checkpoint_wrapper(block, "selective")
    session = RecomputeSession()
    with session, SwapSchedule(prefetch_ahead=0, recompute_ahead=1):
        loss = model(x).square().sum()
    handles = session.handles()
    loss.backward()
    assert [h.recomputes for h in handles] == [1, 1, 1]
    for got, want in zip((p.grad for p in model.parameters()), _reference(x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
