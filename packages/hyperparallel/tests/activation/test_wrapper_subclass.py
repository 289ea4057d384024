"""Regions whose ops return wrapper tensor subclasses: a functional collective's in-flight result
(``AsyncCollectiveTensor``) has a storage object with no memory behind it, so the region keys it,
and counts it, by the tensor it wraps."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor, _maybe_wrap_tensor

from hyperparallel.activation import POLICY_NAMES, checkpoint, track_saved_activations


def _gathered_then_scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul whose output is wrapped as an in-flight collective result (as DTensor's gathers
    return it), then multiplied by itself: autograd saves the wrapper for backward."""
    gathered = _maybe_wrap_tensor(x @ w)
    assert isinstance(gathered, AsyncCollectiveTensor)
    return (gathered * gathered).tanh()


def _wrapper_is_differentiable() -> bool:
    """Whether this torch wraps a collective result inside autograd (``_wrap_tensor_autograd``);
    torch 2.9 returns a detached wrapper, so no gradient could reach the inputs through it."""
    probe = torch.ones(1, requires_grad=True) * 2
    return _maybe_wrap_tensor(probe).grad_fn is not None


@pytest.mark.skipif(
    not _wrapper_is_differentiable(),
    reason="this torch's functional-collective wrapper is detached from autograd",
)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_saved_collective_result_wrapper_gives_reference_gradients(policy):
    torch.manual_seed(0)
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    want = torch.autograd.grad((x @ w).pow(2).tanh().sum(), (x, w))
    with track_saved_activations() as tracker:
        out = checkpoint(_gathered_then_scaled, x, w, policy_fn=policy)
    got = torch.autograd.grad(out.sum(), (x, w))
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)
    # The wrapped (6, 8) float32 product is counted by its real bytes, wherever it went.
    report = tracker.report()
    assert report.total_bytes >= 6 * 8 * 4
