"""One checkpointed region: its saved-tensor hooks, and the wiring of its parts.

Forward runs the function normally (the autograd graph is the real one) under two observers: a
dispatch mode (:mod:`~hyperparallel.activation.recording`) that asks the policy about every op
allocating a new tensor, and saved-tensor hooks (here) that, for each tensor autograd saves,
keep it (saved ops, inputs, weights), hold a host copy (swapped ops) or keep only its position
(recomputed ops). Backward's first unpack of a recomputed tensor replays the function once
(:mod:`~hyperparallel.activation.replay`). Inputs live in
:mod:`~hyperparallel.activation.inputs`, the RNG state in :mod:`~hyperparallel.activation.rng`;
schedules hear about the region through :mod:`~hyperparallel.activation.observers`.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten

from hyperparallel.activation._stored import (
    InputSlot,
    Keep,
    OpRecord,
    RecomputeSlot,
    SavedOutputs,
    SwapSlot,
    storage_address,
)
from hyperparallel.activation.inputs import RegionInputs
from hyperparallel.activation.observers import RegionObserver, RegionStats, active_observers
from hyperparallel.activation.policy import CheckpointPolicy, PolicyFn
from hyperparallel.activation.recording import ForwardMode, OpRecorder
from hyperparallel.activation.replay import Replay
from hyperparallel.activation.report import current_tracker, is_parameter_like, storage_owner
from hyperparallel.activation.rng import ForwardState
from hyperparallel.activation.swap import SwappedStorage, TensorMeta

__all__ = ["Phase", "Region", "RegionStats", "current_region"]


class Phase(enum.Enum):
    FORWARD = "forward"
    WAITING = "waiting for backward"
    REPLAY = "replay"


_CURRENT: contextvars.ContextVar[Region | None] = contextvars.ContextVar(
    "hyperparallel_checkpoint_region", default=None
)


def current_region() -> Region | None:
    """The region whose forward or replay runs in this context, if any."""
    return _CURRENT.get()


class Region:
    """State of one call of :func:`~hyperparallel.activation.checkpoint` from forward until the
    autograd graph that saved its tensors is freed. Implements
    :class:`~hyperparallel.activation.observers.ObservedRegion`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        *,
        policy_fn: PolicyFn | None,
        swap_inputs: bool,
        preserve_rng_state: bool,
        name: str,
        owner: torch.nn.Module | None = None,
    ) -> None:
        self.fn, self.policy_fn, self.name, self.owner = fn, policy_fn, name, owner
        self.swap_inputs = swap_inputs
        self.stats = RegionStats()
        self.phase = Phase.FORWARD
        self.excluding = 0
        # Ops issued by the region's own hooks (views, copies) are not the function's ops.
        self.in_hook = False
        self._call: tuple[tuple, dict] | None = (args, kwargs)
        self._tracker = current_tracker()
        self._inputs = RegionInputs(args, kwargs, name, self._tracker)
        self._input_slots = 0
        self._recorder = OpRecorder(name, policy_fn)
        # A policy that depends only on sizes needs no per-op decisions and no dispatch modes:
        # each tensor saved in the region (not an input, not a weight) is decided as it is saved.
        self._size_rule: Callable[[int], CheckpointPolicy] | None = (
            _recompute_all if policy_fn is None else getattr(policy_fn, "size_rule", None)
        )
        self._mode: ForwardMode | None = None
        self._excluded: list[SavedOutputs] = []
        self._swapped: list[SwappedStorage] = []
        self._needed: set[int] = set()
        self._recomputed: dict[int, torch.Tensor] = {}
        self._replay: Replay | None = None
        self._pack_count = 0
        self._observers: tuple[RegionObserver, ...] = active_observers()
        self._state = ForwardState(self._inputs.device_tensors(), preserve_rng_state)

    @property
    def swaps_anything(self) -> bool:
        """Whether the region holds host copies: swapped op outputs or (soon) its inputs."""
        return bool(self._swapped) or self.swap_inputs

    # ---- forward -------------------------------------------------------------------------

    def run_forward(self) -> Any:
        """Run the function with the region's observers; return its outputs unchanged."""
        for observer in self._observers:
            observer.region_started(self)
        assert self._call is not None
        (args, kwargs), self._call = self._call, None
        token = _CURRENT.set(self)
        try:
            if self._size_rule is None:
                self._mode = ForwardMode(
                    self._recorder, lambda: bool(self.excluding or self.in_hook)
                )
            with (
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
                self._mode or contextlib.nullcontext(),
            ):
                out = self.fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)
            self._mode = None  # the mode refers back to the region: no cycle outlives forward
        self._finish_forward(out)
        return out

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Run a block whose saved tensors are kept and whose ops are not observed."""
        self.excluding += 1
        try:
            if self._mode is not None and _get_current_dispatch_mode() is self._mode:
                with _pop_mode_temporarily():
                    yield
            else:  # another mode sits above ours: it stays, ours skips by the flag
                yield
        finally:
            self.excluding -= 1

    def store_excluded(self, out: Any) -> None:
        """Keep an excluded call's outputs for replay, which will not run that call."""
        self._excluded.append(SavedOutputs(out, None, self.name))

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.in_hook = True
        try:
            return self._pack_slot(tensor)
        finally:
            self.in_hook = False

    def _pack_slot(self, tensor: torch.Tensor) -> Any:
        if self.excluding:
            return self._keep(
                tensor, lambda: f"a tensor saved inside an excluded call in {self.name!r}"
            )
        position = self._pack_count
        self._pack_count += 1
        key = storage_address(tensor)
        record = self._recorder.producer(tensor)
        index = self._inputs.index_of(tensor)
        if (
            record is None
            and self._size_rule is not None
            and index is None
            and not is_parameter_like(tensor)
        ):
            op = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "an op"
            choice = self._size_rule(tensor.untyped_storage().nbytes())
            record = OpRecord(-1 - position, op, choice)
            self._recorder.record_saved(tensor, record)
        if record is None:
            if index is not None and self.swap_inputs:
                self._input_slots += 1
                return InputSlot(index, TensorMeta.of(tensor))
            if index is None:
                return self._keep(tensor, lambda: f"a tensor from outside region {self.name!r}")
            return self._keep(tensor, lambda: f"input {index} of checkpoint region {self.name!r}")
        if record.policy.is_save or (record.policy.is_swap and storage_owner(tensor) is not tensor):
            # A wrapper subclass's storage has no bytes to copy to host: it stays on device.
            return self._keep(tensor, lambda: f"output of {record.op} in {self.name!r}")
        if record.policy.is_swap and key is not None:
            swap = record.swaps.get(key)
            if swap is None:
                # The description holds plain values, not the record or the region: both hold
                # the swap, and a cycle would keep its pinned host buffer out of the pool until
                # the garbage collector runs (a step's worth of new pinned memory every step).
                what = f"output of {record.op} (op {record.index}) in region {self.name!r}"
                swap = record.swaps[key] = SwappedStorage(tensor, functools.partial(str, what))
                self._swapped.append(swap)
            if self._tracker is not None:
                self._tracker.add(("swap", id(swap)), swap.nbytes, "host")
            return SwapSlot(swap, TensorMeta.of(tensor))
        self._needed.add(position)
        if self._tracker is not None:
            storage = tensor.untyped_storage()
            self._tracker.add(
                ("recompute", id(self), record.index, key), storage.nbytes(), "recomputed"
            )
        return RecomputeSlot(position)

    def _keep(self, tensor: torch.Tensor, what: Callable[[], str]) -> Keep:
        if self._tracker is not None:
            self._tracker.add_tensor(tensor, "device")
        return Keep(tensor, tensor._version, what)

    def _finish_forward(self, out: Any) -> None:
        self.phase = Phase.WAITING
        self._recorder.forget_unsaved_swaps()
        if not self._needed:
            # Nothing to recompute: stored outputs only serve slots, which hold their own refs.
            self._recorder.cache.clear()
            self._excluded.clear()
            if not self._input_slots:
                self._inputs.release()
        elif self._tracker is not None:
            for entry in (*self._recorder.cache.values(), *self._excluded):
                if isinstance(entry, SavedOutputs):
                    for t in entry.tensors():
                        self._tracker.add_tensor(t, "device")
                else:
                    for swap in entry.record.swaps.values():
                        self._tracker.add(("swap", id(swap)), swap.nbytes, "host")
        if self._tracker is not None:
            self._tracker.regions += 1
            for t in self._inputs.device_tensors():
                self._tracker.add_tensor(t, "device")
        self._notify_finished(out)

    def _notify_finished(self, out: Any) -> None:
        """Tell the observers; hook backward's arrival for those who asked."""
        listeners = [o for o in self._observers if o.wants_backward_hook(self)]
        if listeners:
            grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            grads = [t for t in grads if t.requires_grad]
            if grads:
                me = weakref.ref(self)

                def reached(_grad: torch.Tensor) -> None:
                    if (region := me()) is not None:
                        for observer in listeners:
                            observer.backward_reached(region)

                torch.autograd.graph.register_multi_grad_hook(grads, reached, mode="any")
        for observer in self._observers:
            observer.region_finished(self)
        if self.swap_inputs and not any(o.schedules_offload for o in self._observers):
            self.offload_inputs()

    # ---- swapping ------------------------------------------------------------------------

    def offload_inputs(self) -> None:
        """Copy the region's inputs to host and drop the region's device references."""
        if self.swap_inputs:
            self._inputs.offload()

    def prefetch(self) -> None:
        """Start copying back everything this region swapped (inputs and op outputs)."""
        self._inputs.prefetch()
        for swap in self._swapped:
            swap.prefetch()

    # ---- backward ------------------------------------------------------------------------

    def _unpack(self, slot: Any) -> torch.Tensor:
        if isinstance(slot, Keep):
            if not is_parameter_like(slot.tensor) and slot.tensor._version != slot.version:
                raise RuntimeError(
                    f"{slot.what()} was saved for backward and then modified in place (version "
                    f"{slot.version} -> {slot.tensor._version}); backward would use the "
                    "modified values. Clone it before modifying it."
                )
            return slot.tensor
        if isinstance(slot, SwapSlot):
            return slot.storage.view(slot.meta)
        if isinstance(slot, InputSlot):
            return self._inputs.tensor(slot.index, slot.meta)
        if slot.position not in self._recomputed:
            self.recompute()
        return self._recomputed.pop(slot.position)

    def recompute_now(self) -> None:
        """Recompute ahead of backward; an FSDP2 region first gathers its parameters."""
        unshard = getattr(self.owner, "unshard", None)
        if unshard is not None and hasattr(self.owner, "reshard"):
            unshard()
        self.recompute()

    def recompute(self) -> None:
        """Replay the region now so backward finds its tensors; a no-op while results wait."""
        if self._recomputed or not self._needed:
            return
        args, kwargs = self._inputs.call_for_replay()
        for swap in self._swapped:  # everything replay may read, in one batch of copies
            swap.prefetch()
        replay = Replay(self.name, self._needed, self._recorder.cache, self._excluded)
        self._replay = replay
        token = _CURRENT.set(self)
        self.phase = Phase.REPLAY
        try:
            results = replay.run(self.fn, args, kwargs, self._state, self._size_rule is None)
        finally:
            _CURRENT.reset(token)
            self.phase = Phase.WAITING
            self._replay = None
        self._recomputed = results
        self.stats.recomputes += 1
        self.stats.replayed_ops += replay.ops

    def replay_excluded(self) -> Any:
        """During replay: the next excluded call's stored outputs (the call is not run)."""
        assert self._replay is not None, "replay_excluded outside a replay"
        return self._replay.replay_excluded()


def _recompute_all(nbytes: int) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE
