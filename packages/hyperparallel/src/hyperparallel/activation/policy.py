"""Per-op activation policies: save, recompute or swap each op's output, and ready-made rules.

A policy function is called once per op that allocates a new tensor inside a checkpointed region,
after the op ran, as ``policy_fn(ctx, op, *args, **kwargs)``; it returns a
:class:`CheckpointPolicy` (or None for "no opinion", which means PREFER_RECOMPUTE). The names
follow ``torch.utils.checkpoint.CheckpointPolicy`` and add MUST_SWAP.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

aten = torch.ops.aten


class CheckpointPolicy(enum.StrEnum):
    """What happens to one op's output between forward and backward.

    MUST_* choices are kept or refused with an error; PREFER_* may be changed when keeping them
    would be wrong (an op saved for backward and later modified in place inside the region is
    recomputed instead).
    """

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_SWAP = "must_swap"

    @property
    def is_save(self) -> bool:
        """Kept on device."""
        return self in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    @property
    def is_swap(self) -> bool:
        """Copied to host, device copy freed, copied back for backward."""
        return self is CheckpointPolicy.MUST_SWAP

    @property
    def is_recompute(self) -> bool:
        """Dropped after forward, computed again for backward."""
        return self in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)

    @property
    def is_must(self) -> bool:
        """A requirement, not a preference."""
        return self.name.startswith("MUST")


@dataclass(frozen=True)
class PolicyContext:
    """What a policy function knows besides the op and its arguments.

    Attributes:
        region: name of the checkpointed region (the wrapped module's class, or the function).
        op_index: position of the op in the region's forward (counting every op).
        outputs: the op's tensor outputs (already computed).
    """

    region: str
    op_index: int
    outputs: tuple[torch.Tensor, ...]

    @property
    def output_nbytes(self) -> int:
        """Bytes of the op's tensor outputs."""
        return sum(t.numel() * t.element_size() for t in self.outputs)


PolicyFn = Callable[..., CheckpointPolicy | None]
"""``policy_fn(ctx: PolicyContext, op: OpOverload, *args, **kwargs) -> CheckpointPolicy | None``.

A policy whose answer depends only on the size of what is saved may also carry a
``size_rule(nbytes) -> CheckpointPolicy`` attribute (``uniform`` and ``swap_saved_above`` over it
do): regions then decide per saved tensor when autograd saves it, with no dispatch mode observing
every op, which is much cheaper in Python time."""


def _ops(*names: str) -> frozenset:
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and overload in op.overloads():
            found.append(getattr(op, overload))
    return frozenset(found)


MATMUL_OPS = _ops(
    "mm.default",
    "bmm.default",
    "addmm.default",
    "baddbmm.default",
    "_scaled_mm.default",
    "convolution.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_flash_attention_forward.default",
    "_efficient_attention_forward.default",
)
"""Compute-bound ops whose outputs are worth keeping: matmuls, convolutions, attention kernels."""

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})


def is_collective(op: object) -> bool:
    """Whether ``op`` is a (functional) collective: recomputing it would repeat communication."""
    return getattr(op, "namespace", None) in _COLLECTIVE_NAMESPACES


def save_matmuls_and_collectives(extra_ops: Iterable[object] = ()) -> PolicyFn:
    """Keep outputs of matmuls, attention kernels and collectives on device, recompute the rest.

    The cheap elementwise ops around matmuls (norms, activations, RoPE, casts) are what
    recompute replays: they cost little time but hold as many bytes as the matmul outputs.
    """
    saved = MATMUL_OPS | frozenset(extra_ops)

    def policy(ctx: PolicyContext, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op in saved or is_collective(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def uniform(choice: CheckpointPolicy) -> PolicyFn:
    """The same choice for every op (e.g. ``uniform(MUST_SWAP)`` swaps everything)."""
    choice = CheckpointPolicy(choice)

    def policy(ctx: PolicyContext, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return choice

    # mypy cannot type attributes set on a function; regions read it with getattr (PolicyFn)
    policy.size_rule = lambda nbytes: choice  # type: ignore[attr-defined]
    return policy


def swap_saved_above(threshold_bytes: int, base: PolicyFn | None = None) -> PolicyFn:
    """Swap to host the outputs ``base`` would save when they hold at least ``threshold_bytes``.

    Args:
        threshold_bytes: smallest output (all tensor outputs of the op together) worth a copy;
            small tensors cost more in copy latency than they free.
        base: the policy deciding save versus recompute (default:
            :func:`save_matmuls_and_collectives`).
    """
    if threshold_bytes < 0:
        raise ValueError(f"threshold_bytes={threshold_bytes}: must be >= 0")
    base = base or save_matmuls_and_collectives()

    def policy(
        ctx: PolicyContext, op: object, *args: object, **kwargs: object
    ) -> CheckpointPolicy | None:
        choice = base(ctx, op, *args, **kwargs)
        if choice is not None and choice.is_save and ctx.output_nbytes >= threshold_bytes:
            if is_collective(op) and choice.is_must:
                return choice  # a collective's output stays where the next collective wants it
            return CheckpointPolicy.MUST_SWAP
        return choice

    base_rule = getattr(base, "size_rule", None)
    if base_rule is not None:

        def size_rule(nbytes: int) -> CheckpointPolicy:
            choice = base_rule(nbytes)
            return (
                CheckpointPolicy.MUST_SWAP
                if choice.is_save and nbytes >= threshold_bytes
                else choice
            )

        policy.size_rule = size_rule  # type: ignore[attr-defined]  # as in uniform()
    return policy


def compose(*policies: PolicyFn) -> PolicyFn:
    """Ask each policy in order: the first MUST_* answer wins, else the first PREFER_* answer,
    else PREFER_RECOMPUTE. Lets narrow rules (e.g. "always save the router") sit before broad
    ones."""
    if not policies:
        raise ValueError("compose() needs at least one policy function")

    def policy(ctx: PolicyContext, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        preferred = None
        for fn in policies:
            choice = fn(ctx, op, *args, **kwargs)
            if choice is None:
                continue
            choice = CheckpointPolicy(choice)
            if choice.is_must:
                return choice
            preferred = preferred or choice
        return preferred or CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def resolve(name_or_fn: str | PolicyFn | None, swap_threshold_bytes: int = 1 << 16) -> PolicyFn:
    """A policy function from a config name: ``recompute`` (full checkpoint), ``save`` (keep all,
    like no checkpoint), ``swap`` (every saved tensor of at least ``swap_threshold_bytes`` to
    host, smaller ones kept), ``selective`` (save matmuls and collectives, recompute the rest) or
    ``selective_swap`` (the same, swapping the saved ones above the threshold)."""
    if callable(name_or_fn):
        return name_or_fn
    named: dict[str, Callable[[], PolicyFn]] = {
        "recompute": lambda: uniform(CheckpointPolicy.PREFER_RECOMPUTE),
        "save": lambda: uniform(CheckpointPolicy.PREFER_SAVE),
        "swap": lambda: swap_saved_above(
            swap_threshold_bytes, uniform(CheckpointPolicy.PREFER_SAVE)
        ),
        "selective": save_matmuls_and_collectives,
        "selective_swap": lambda: swap_saved_above(swap_threshold_bytes),
    }
    key = "recompute" if name_or_fn is None else name_or_fn
    if key not in named:
        raise ValueError(f"policy {name_or_fn!r}: choose one of {', '.join(named)}")
    return named[key]()


POLICY_NAMES = ("recompute", "save", "swap", "selective", "selective_swap")
