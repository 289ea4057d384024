"""The replay of a region for backward: run its function once more, with the forward's RNG and
autocast state, returning saved and swapped ops' stored outputs instead of running them, and
stop as soon as every tensor backward needs has been produced again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from hyperparallel.activation._stored import SavedOutputs, SwappedOutputs, op_info
from hyperparallel.activation.observers import no_observers
from hyperparallel.activation.rng import ForwardState


class _StopReplay(Exception):
    """Raised from the replay's pack hook once every tensor backward needs exists."""


class Replay:
    """One replay of a region's function.

    Args:
        name: the region's name, for error messages.
        needed: pack positions (the order autograd saved tensors in forward) backward needs.
        cache: op index -> stored outputs of saved and swapped ops.
        excluded: stored outputs of excluded calls, in call order.
    """

    def __init__(
        self,
        name: str,
        needed: set[int],
        cache: dict[int, SavedOutputs | SwappedOutputs],
        excluded: list[SavedOutputs],
    ) -> None:
        self.name, self.needed, self.cache, self.excluded = name, needed, cache, excluded
        self.results: dict[int, torch.Tensor] = {}
        self.ops = self.packs = self.excluded_calls = 0
        # Ops issued by the pack hook itself (detach) are not the function's ops.
        self.in_hook = False

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        state: ForwardState,
        per_op: bool,
    ) -> dict[int, torch.Tensor]:
        """Replay ``fn(*args, **kwargs)``; return pack position -> recomputed tensor.

        Args:
            per_op: the region decided per op in forward, so stored outputs are substituted op
                by op (a dispatch mode); size-rule regions recompute every op.

        Raises:
            RuntimeError: the replay saved fewer tensors than forward did.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(state.restored())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(no_observers())
            stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(self._pack, _never_unpacked)
            )
            if per_op:
                stack.enter_context(_ReplayMode(self))
            with contextlib.suppress(_StopReplay):
                fn(*args, **kwargs)
        missing = self.needed - self.results.keys()
        if missing:
            raise RuntimeError(
                f"recompute of checkpoint region {self.name!r} saved {self.packs} "
                f"tensors where forward saved more ({len(missing)} missing): the function must "
                "run the same ops on replay (no data-dependent control flow on values that "
                "differ between forward and recompute)."
            )
        return self.results

    def replay_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Return a stored output for saved and swapped ops; run everything else."""
        index = self.ops
        self.ops += 1
        entry = self.cache.get(index)
        if entry is None or op_info(func).seeded:
            return func(*args, **kwargs)  # random ops always run: later ones need their draws
        out = entry.materialize()
        return func(*args, **kwargs) if out is None else out

    def replay_excluded(self) -> Any:
        """The next excluded call's stored outputs, with their forward ``requires_grad``."""
        entry = self.excluded[self.excluded_calls]
        self.excluded_calls += 1
        grads = iter(entry.requires_grad)
        return tree_map(
            lambda x: x.requires_grad_(next(grads)) if isinstance(x, torch.Tensor) else x,
            entry.materialize(),
        )

    def _pack(self, tensor: torch.Tensor) -> None:
        position = self.packs
        self.packs += 1
        if position in self.needed:
            self.in_hook = True
            try:
                self.results[position] = tensor.detach()
            finally:
                self.in_hook = False
            if len(self.results) == len(self.needed):
                raise _StopReplay
        return None


class _ReplayMode(TorchDispatchMode):
    def __init__(self, replay: Replay) -> None:
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.replay.in_hook:
            return func(*args, **(kwargs or {}))
        return self.replay.replay_op(func, args, kwargs or {})


def _never_unpacked(packed: Any) -> torch.Tensor:
    raise RuntimeError("the graph built while recomputing a checkpoint region is never used")
