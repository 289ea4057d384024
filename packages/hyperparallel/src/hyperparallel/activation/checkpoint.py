"""``checkpoint``: run a function as one region with a per-op save / recompute / swap policy;
``checkpoint_wrapper`` / ``swap_wrapper`` make a module's every call such a region."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from hyperparallel.activation.policy import CheckpointPolicy, PolicyFn, resolve, uniform
from hyperparallel.activation.region import Phase, Region, current_region

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy_fn: PolicyFn | str | None = None,
    swap_inputs: bool = False,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping for backward only what ``policy_fn`` asks for.

    Non-reentrant: the autograd graph is the one forward builds; only the tensors autograd
    saves are intercepted. Per op that allocates a tensor, ``policy_fn(ctx, op, *args,
    **kwargs)`` returns a :class:`CheckpointPolicy`: saved ops keep their outputs on device,
    swapped ops have the outputs backward needs copied to host (device memory freed once forward
    drops them, copied back before backward reads them), recomputed ops run again in backward,
    in one replay of ``fn`` that reuses the saved and swapped outputs and replays random ops with
    the forward's RNG state. Gradients equal those without checkpointing.

    Args:
        fn: the region; must run the same ops when replayed.
        *args: its positional arguments.
        policy_fn: a policy function, a name understood by
            :func:`~hyperparallel.activation.policy.resolve`, or None to recompute everything.
        swap_inputs: copy the region's tensor inputs to host after its forward (or when a
            :class:`~hyperparallel.activation.SwapSchedule` says) and back for backward.
        preserve_rng_state: replay with the forward's CPU and device RNG states (needed for
            dropout); False saves the state capture when ``fn`` draws no random numbers.
        **kwargs: its keyword arguments.

    Returns:
        ``fn``'s outputs.

    Raises:
        ValueError: ``checkpoint`` called inside another region's forward.
        RuntimeError: in backward, when a tensor kept or swapped for backward was modified in
            place after it was saved (checked with its version counter).
    """
    outer = current_region()
    if outer is not None and outer.phase is Phase.FORWARD and not outer.excluding:
        raise ValueError(
            f"checkpoint({_name(fn)}) inside checkpoint region {outer.name!r}: nested regions "
            "are not supported; checkpoint the outer or the inner block, not both"
        )
    if outer is not None and outer.phase is Phase.REPLAY:
        return fn(*args, **kwargs)  # unreachable in practice: nesting is refused above
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing is saved for backward
    region = Region(
        fn,
        args,
        kwargs,
        policy_fn=resolve(policy_fn) if isinstance(policy_fn, str) else policy_fn,
        swap_inputs=swap_inputs,
        preserve_rng_state=preserve_rng_state,
        name=_name(fn),
        owner=getattr(fn, "__self__", None),
    )
    return region.run_forward()


def _name(fn: Callable[..., Any]) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return type(owner).__name__
    return getattr(fn, "__qualname__", type(fn).__name__)


def checkpoint_wrapper(
    module: ModuleT,
    policy_fn: PolicyFn | str | None = None,
    swap_inputs: bool = False,
    preserve_rng_state: bool = True,
) -> ModuleT:
    """Make every call of ``module`` a :func:`checkpoint` region; returns the same module.

    The module is changed in place (its ``forward``), so parameter names, ``state_dict`` keys
    and FSDP2 ``fully_shard`` (applied before or after) are unaffected.

    Raises:
        ValueError: ``module`` is already wrapped.
    """
    if "forward" in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} already has an instance forward (wrapped twice?); "
            "wrap a module once"
        )
    original = module.forward
    policy = resolve(policy_fn) if isinstance(policy_fn, str) else policy_fn

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            original,
            *args,
            policy_fn=policy,
            swap_inputs=swap_inputs,
            preserve_rng_state=preserve_rng_state,
            **kwargs,
        )

    module.forward = forward
    return module


def swap_wrapper(
    module: ModuleT, policy_fn: PolicyFn | str | None = None, swap_inputs: bool = False
) -> ModuleT:
    """:func:`checkpoint_wrapper` whose default policy swaps every saved tensor to host and
    recomputes nothing (MUST_SWAP for every op)."""
    return checkpoint_wrapper(
        module, policy_fn or uniform(CheckpointPolicy.MUST_SWAP), swap_inputs=swap_inputs
    )
