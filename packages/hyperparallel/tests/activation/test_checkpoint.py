"""Checkpointed regions: gradients equal no-checkpoint for every policy, mixing, exclusion,
in-place modification errors, nesting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyperparallel.activation import (
    POLICY_NAMES,
    CheckpointPolicy,
    checkpoint,
    checkpoint_exclude_wrapper,
    checkpoint_wrapper,
    resolve,
    swap_saved_above,
    track_saved_activations,
    uniform,
)
from hyperparallel.models.moe import MoEConfig, MoETransformer

aten = torch.ops.aten


class DropoutBlock(nn.Module):
    """Norm, matmul, GELU, dropout, matmul, residual: random ops between saved ones."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.drop(torch.nn.functional.gelu(self.up(self.norm(x))))))


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(DropoutBlock() for _ in range(3)))


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    model(x).pow(2).mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


MIXED = {
    aten.addmm.default: CheckpointPolicy.MUST_SAVE,
    aten.native_layer_norm.default: CheckpointPolicy.MUST_SWAP,
}


def _mixed(ctx, op, *args, **kwargs):
    return MIXED.get(op, CheckpointPolicy.PREFER_RECOMPUTE)


@pytest.mark.parametrize("swap_inputs", [False, True])
@pytest.mark.parametrize("policy", [*POLICY_NAMES, _mixed])
def test_gradients_equal_no_checkpoint_with_dropout(policy, swap_inputs):
    """Every policy (and swapped inputs) gives the reference gradients; dropout masks replay."""
    x = torch.randn(4, 8, 16)
    want = _grads(_stack(), x)
    model = _stack()
    for block in model:
        checkpoint_wrapper(
            block,
            swap_saved_above(0) if policy == "selective_swap" else policy,
            swap_inputs=swap_inputs,
        )
    _assert_close(_grads(model, x), want)


def test_one_region_mixes_save_swap_and_recompute():
    """One region with all three placements: each is counted, gradients still match."""
    x = torch.randn(4, 8, 16)
    want = _grads(_stack(), x)
    model = _stack()
    for block in model:
        checkpoint_wrapper(block, _mixed)
    torch.manual_seed(1)
    xg = x.clone().requires_grad_(True)
    with track_saved_activations() as tracker:
        loss = model(xg).pow(2).mean()
    report = tracker.report()
    loss.backward()
    _assert_close([xg.grad, *(p.grad for p in model.parameters())], want)
    assert report.device_bytes > 0 and report.host_bytes > 0 and report.recomputed_bytes > 0
    assert report.regions == 3


def test_report_counts_exact_bytes_by_placement():
    """tanh(x @ w): mm saves x (an input), tanh saves its output; weights are not counted."""
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)  # an activation (no grad needed), 128 bytes

    def fn(x):
        return torch.tanh(x @ w)

    def report(**kw):
        with track_saved_activations() as tracker:
            out = checkpoint(fn, x, **kw)
        out.sum().backward()
        return tracker.report()

    recompute = report()
    assert (recompute.device_bytes, recompute.host_bytes, recompute.recomputed_bytes) == (
        128,
        0,
        128,
    )
    swap = report(policy_fn=uniform(CheckpointPolicy.MUST_SWAP))
    assert (swap.device_bytes, swap.host_bytes, swap.recomputed_bytes) == (128, 128, 0)
    inputs = report(swap_inputs=True)
    assert (inputs.device_bytes, inputs.host_bytes, inputs.recomputed_bytes) == (0, 128, 128)
    with track_saved_activations() as tracker:
        fn(x).sum()
    assert tracker.report().device_bytes == 256  # no checkpoint: x and tanh's output


def test_moe_model_gradients_and_memory_for_every_policy():
    """The train model: each policy matches no-checkpoint gradients and the expected bytes."""
    torch.manual_seed(0)
    cfg = MoEConfig(dim=32, n_layers=2, n_heads=2, n_experts=4, ffn_dim=64, max_seq_len=32)
    ref, tokens = MoETransformer(cfg), torch.randint(0, 256, (2, 32))

    def run(model):
        with track_saved_activations() as tracker:
            logits, balance = model(tokens)
        (logits.pow(2).mean() + balance).backward()
        return [p.grad for p in model.parameters()], tracker.report()

    want, none = run(copy.deepcopy(ref))
    reports = {}
    for name in POLICY_NAMES:
        model = copy.deepcopy(ref)
        for layer in model.layers:
            checkpoint_wrapper(layer, resolve(name, swap_threshold_bytes=1024))
        got, reports[name] = run(model)
        _assert_close(got, want)
    assert reports["save"].device_bytes == none.device_bytes
    assert reports["recompute"].device_bytes < 0.3 * none.device_bytes
    assert reports["swap"].recomputed_bytes == 0
    # Every saved byte is either kept or swapped: the sum is the no-checkpoint total.
    assert reports["swap"].device_bytes + reports["swap"].host_bytes == none.device_bytes
    assert reports["swap"].host_bytes > 0.8 * none.device_bytes
    assert reports["recompute"].device_bytes < reports["selective"].device_bytes
    assert reports["selective"].device_bytes < none.device_bytes


def test_excluded_call_is_not_recomputed_nor_observed():
    """An excluded function runs once (forward only) and the policy never sees its ops."""
    calls, seen = [], []

    @checkpoint_exclude_wrapper
    def expensive(h):
        calls.append(1)
        return torch.sin(h) @ h.transpose(0, 1)

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        h = torch.cos(x)
        return torch.tanh(expensive(h)).sum()

    x = torch.randn(6, 6, requires_grad=True)
    fn(x).backward()
    want, x.grad = x.grad, None
    calls.clear()
    checkpoint(fn, x, policy_fn=policy).backward()
    torch.testing.assert_close(x.grad, want, atol=1e-6, rtol=0)
    assert calls == [1]
    assert aten.sin.default not in seen and aten.cos.default in seen


def test_in_place_change_of_swapped_tensor_fails_clearly():
    """A swapped output modified before backward raises, naming the op (version counter)."""
    keep = {}

    def fn(x):
        keep["h"] = torch.exp(x)
        return keep["h"] * 2

    x = torch.randn(5, requires_grad=True)
    out = checkpoint(fn, x, policy_fn=uniform(CheckpointPolicy.MUST_SWAP))
    keep["h"].add_(1)
    with pytest.raises(RuntimeError, match=r"ExpBackward0.*swapped to host.*modified in place"):
        out.sum().backward()


def test_in_place_change_of_region_input_fails_clearly():
    """An input modified after forward would poison the recompute: it raises instead."""
    x = torch.randn(5, requires_grad=True) * 1.0
    out = checkpoint(lambda t: torch.sin(t) * 2, x)
    x.mul_(3)
    with pytest.raises(RuntimeError, match=r"input 0 of checkpoint region .* modified in place"):
        out.sum().backward()


def test_must_save_output_modified_inside_region_is_refused():
    """MUST_SAVE on an output the region then modifies in place is an error, not stale data."""

    def fn(x):
        y = torch.exp(x)
        y.add_(1)
        return y * x

    with pytest.raises(RuntimeError, match="MUST_SAVE"):
        checkpoint(
            fn,
            torch.randn(3, requires_grad=True),
            policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE,  # decided per op
        )


def test_prefer_save_output_modified_inside_region_is_recomputed():
    """PREFER_SAVE falls back to recompute for an output modified in place (MoE's index_add_)."""

    def fn(x):
        y = torch.zeros_like(x)
        y.index_add_(0, torch.tensor([0, 2]), x[:2] * 3)
        return (y * x).sum()

    x = torch.randn(4, requires_grad=True)
    fn(x).backward()
    want, x.grad = x.grad, None
    checkpoint(fn, x, policy_fn=lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_SAVE).backward()
    torch.testing.assert_close(x.grad, want)


def test_nested_regions_are_refused():
    """checkpoint inside a region's forward names both and says what to do."""
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="nested regions are not supported"):
        checkpoint(lambda t: checkpoint(torch.sin, t), x)


def test_tracker_keeps_autograd_in_place_check_outside_regions():
    """Counting through a hook must not hide an in-place change to a saved tensor."""
    x = torch.randn(4, requires_grad=True)
    with track_saved_activations():
        y = torch.exp(x)
        out = (y * 2).sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match=r"modified in place afterwards \(version 0 -> 1\)"):
        out.backward()


def test_swapped_host_buffers_return_to_the_pool_without_garbage_collection():
    """Once backward frees the graph, every host buffer a step swapped to (op outputs and
    region inputs) is back in the pool, so the next step reuses it instead of allocating (and
    on accelerators pinning) a new one. A reference cycle between a region and its swaps kept
    them until a gc run: the pool grew by one step's swapped bytes per step."""
    import gc

    from hyperparallel.activation import SwapSchedule
    from hyperparallel.activation.swap import _ENGINE

    torch.manual_seed(0)
    blocks = [
        checkpoint_wrapper(DropoutBlock(32), uniform(CheckpointPolicy.MUST_SWAP), swap_inputs=True)
        for _ in range(3)
    ]
    x = torch.randn(8, 32, requires_grad=True)

    def step() -> None:
        with SwapSchedule(offload_after=1):
            h = x
            for block in blocks:
                h = block(h)
            h.sum().backward()

    enabled = gc.isenabled()
    gc.disable()
    try:
        step()  # the pool's first buffers
        after_first = _ENGINE.pool.nbytes
        for _ in range(3):
            step()
        assert _ENGINE.pool.nbytes == after_first
    finally:
        if enabled:
            gc.enable()
    assert after_first > 0
