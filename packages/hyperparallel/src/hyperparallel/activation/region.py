"""One checkpointed region: per-op save / swap / recompute bookkeeping, its hooks, its replay.

Forward runs the function normally (the autograd graph is the real one) under two observers: a
``TorchDispatchMode`` that asks the policy about every op allocating a new tensor, and
saved-tensor hooks that, for each tensor autograd saves, keep it (saved ops, inputs, weights),
hold a host copy (swapped ops) or keep only its position (recomputed ops). Backward's first
unpack of a recomputed tensor replays the function once with the forward's RNG state: saved and
swapped ops return their stored outputs instead of running, packs are matched by position, and
replay stops as soon as the last tensor backward needs has been produced.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states

from hyperparallel.activation._stored import (
    InputSlot,
    Keep,
    OpRecord,
    RecomputeSlot,
    SavedOutputs,
    SwappedOutputs,
    SwapSlot,
    mutated_args,
    op_info,
    storage_address,
    tensors_of,
)
from hyperparallel.activation.policy import CheckpointPolicy, PolicyContext, PolicyFn
from hyperparallel.activation.report import current_tracker, is_parameter_like
from hyperparallel.activation.schedule import current_session, no_session
from hyperparallel.activation.swap import SwappedStorage, TensorMeta, current_schedule, no_schedule


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


class _StopReplay(Exception):
    """Raised from the replay's pack hook once every tensor backward needs exists."""


@dataclass
class RegionStats:
    """Counters a :class:`~hyperparallel.activation.schedule.RecomputeHandle` reads."""

    recomputes: int = 0
    replayed_ops: int = 0


class _ForwardMode(TorchDispatchMode):
    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (self.region.excluding or self.region.in_hook):
            self.region.record_op(func, args, kwargs, out)
        return out


class _ReplayMode(TorchDispatchMode):
    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.region.in_hook:
            return func(*args, **(kwargs or {}))
        return self.region.replay_op(func, args, kwargs or {})


class Region:
    """State of one call of :func:`~hyperparallel.activation.checkpoint` from forward until the
    autograd graph that saved its tensors is freed."""

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
        self.swap_inputs, self.preserve_rng_state = swap_inputs, preserve_rng_state
        self.stats = RegionStats()
        self.phase = Phase.FORWARD
        self.excluding = 0
        # Ops issued by the region's own hooks (views, copies) are not the function's ops.
        self.in_hook = False
        self._call: tuple[tuple, dict] | None = (args, kwargs)
        leaves, self._spec = tree_flatten((args, kwargs))
        # Non-tensor leaves only: the region holds its tensor inputs in _inputs / _input_swaps.
        self._leaves: list[Any] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._inputs = {i: x for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        self._input_meta = {i: TensorMeta.of(x) for i, x in self._inputs.items()}
        self._input_versions = {i: x._version for i, x in self._inputs.items()}
        self._input_ptrs = {
            storage_address(x): i
            for i, x in self._inputs.items()
            if not is_parameter_like(x) and x.untyped_storage().nbytes()
        }
        self._input_swaps: dict[int, SwappedStorage] = {}
        self._input_slots = 0
        # storage address -> (weak ref to that storage, the op that allocated it); the weak ref
        # tells a live storage from a freed one whose address was reused.
        self._produced: dict[tuple[torch.device, int], tuple[StorageWeakRef, OpRecord]] = {}
        # A policy that depends only on sizes needs no per-op decisions and no dispatch modes:
        # each tensor saved in the region (not an input, not a weight) is decided as it is saved.
        self._size_rule: Callable[[int], CheckpointPolicy] | None = (
            _recompute_all if policy_fn is None else getattr(policy_fn, "size_rule", None)
        )
        self._cache: dict[int, SavedOutputs | SwappedOutputs] = {}
        self._excluded: list[SavedOutputs] = []
        self._swapped: list[SwappedStorage] = []
        self._needed: set[int] = set()
        self._recomputed: dict[int, torch.Tensor] = {}
        self._op_count = self._pack_count = 0
        self._tracker = current_tracker()
        self._schedule = current_schedule()
        tensors = list(self._inputs.values())
        self._cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self._device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
        self._device_rng = (
            get_device_states(*tensors) if preserve_rng_state and self._device_type else None
        )
        self._autocast = {
            dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in {"cpu", self._device_type or "cpu"}
        }

    # ---- forward -------------------------------------------------------------------------

    def run_forward(self) -> Any:
        """Run the function with the region's observers; return its outputs unchanged."""
        if self._schedule is not None:
            self._schedule.region_started(self)
        assert self._call is not None
        (args, kwargs), self._call = self._call, None
        token = _CURRENT.set(self)
        try:
            self._mode = _ForwardMode(self) if self._size_rule is None else None
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

    def record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Ask the policy about ``func``'s new outputs; note who made each storage."""
        index = self._op_count
        self._op_count += 1
        info = op_info(func)
        if info.mutated:
            for written in mutated_args(info, args, kwargs):
                self._demote(self._producer(written), func)
        if info.returns_alias:
            return  # a view or an in-place op: the storage's first producer decides
        fresh = [t for t in tensors_of(out) if t.numel()]
        if not fresh:
            return
        choice = None
        if self.policy_fn is not None:
            ctx = PolicyContext(self.name, index, tuple(fresh))
            choice = self.policy_fn(ctx, func, *args, **kwargs)
        choice = CheckpointPolicy(choice or CheckpointPolicy.PREFER_RECOMPUTE)
        record = OpRecord(index, func, choice)
        if choice.is_save:
            self._cache[index] = SavedOutputs(out, record, self.name)
        elif choice.is_swap:
            self._cache[index] = SwappedOutputs(out, record)
        for t in fresh:
            self._produced[storage_address(t)] = (StorageWeakRef(t.untyped_storage()), record)

    def _producer(self, tensor: torch.Tensor) -> OpRecord | None:
        """The region op that allocated ``tensor``'s storage, if the storage is still that one."""
        entry = self._produced.get(storage_address(tensor))
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def _demote(self, record: OpRecord | None, func: Any) -> None:
        if record is None or record.policy.is_recompute:
            return
        if record.policy is CheckpointPolicy.MUST_SAVE:
            raise RuntimeError(
                f"{func} modifies in place the output of {record.op} (op {record.index}) in "
                f"checkpoint region {self.name!r}, which the policy marks MUST_SAVE: the saved "
                "value would be the modified one. Use PREFER_SAVE (recomputed instead) or "
                "clone before modifying."
            )
        # A stored copy would be stale once modified: the only correct choice is to recompute.
        record.policy = CheckpointPolicy.PREFER_RECOMPUTE
        self._cache.pop(record.index, None)
        record.swaps = {}

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
        record = self._producer(tensor)
        index = self._input_ptrs.get(key)
        if (
            record is None
            and self._size_rule is not None
            and index is None
            and not is_parameter_like(tensor)
        ):
            op = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "an op"
            choice = self._size_rule(tensor.untyped_storage().nbytes())
            record = OpRecord(-1 - position, op, choice)
            self._produced[key] = (StorageWeakRef(tensor.untyped_storage()), record)
        if record is None:
            if index is not None and self.swap_inputs:
                self._input_slots += 1
                return InputSlot(index, TensorMeta.of(tensor))
            if index is None:
                return self._keep(tensor, lambda: f"a tensor from outside region {self.name!r}")
            return self._keep(tensor, lambda: f"input {index} of checkpoint region {self.name!r}")
        if record.policy.is_save:
            return self._keep(tensor, lambda: f"output of {record.op} in {self.name!r}")
        if record.policy.is_swap:
            swap = record.swaps.get(key)
            if swap is None:
                swap = record.swaps[key] = SwappedStorage(
                    tensor,
                    lambda: f"output of {record.op} (op {record.index}) in region {self.name!r}",
                )
                self._swapped.append(swap)
            if self._tracker is not None:
                self._tracker.add(("swap", id(swap)), swap.nbytes, "host")
            return SwapSlot(swap, TensorMeta.of(tensor))
        self._needed.add(position)
        if self._tracker is not None:
            storage = tensor.untyped_storage()
            key = ("recompute", id(self), record.index, key)
            self._tracker.add(key, storage.nbytes(), "recomputed")
        return RecomputeSlot(position)

    def _keep(self, tensor: torch.Tensor, what: Callable[[], str]) -> Keep:
        if self._tracker is not None:
            self._tracker.add_tensor(tensor, "device")
        return Keep(tensor, tensor._version, what)

    def _finish_forward(self, out: Any) -> None:
        self.phase = Phase.WAITING
        for index, entry in list(self._cache.items()):
            if isinstance(entry, SwappedOutputs) and not entry.record.swaps:
                del self._cache[index]  # never saved: if replay needs it, replay runs the op
        if not self._needed:
            # Nothing to recompute: stored outputs only serve slots, which hold their own refs.
            self._cache.clear()
            self._excluded.clear()
            if not self._input_slots:
                self._inputs.clear()
        elif self._tracker is not None:
            for entry in (*self._cache.values(), *self._excluded):
                if isinstance(entry, SavedOutputs):
                    for t in entry.tensors():
                        self._tracker.add_tensor(t, "device")
                else:
                    for swap in entry.record.swaps.values():
                        self._tracker.add(("swap", id(swap)), swap.nbytes, "host")
        if self._tracker is not None:
            self._tracker.regions += 1
            for t in self._inputs.values():
                self._tracker.add_tensor(t, "device")
        session = current_session()
        if session is not None:
            session.add(self)
        if self._schedule is not None:
            wanted = self._swapped or self.swap_inputs or self._schedule.recompute_ahead
            if wanted and self._schedule.needs_backward_hook:
                grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                grads = [t for t in grads if t.requires_grad]
                if grads:
                    me, schedule = weakref.ref(self), self._schedule

                    def reached(_grad: torch.Tensor) -> None:
                        if (region := me()) is not None:
                            schedule.backward_reached(region)

                    torch.autograd.graph.register_multi_grad_hook(grads, reached, mode="any")
            self._schedule.region_finished(self)
        elif self.swap_inputs:
            self.offload_inputs()

    # ---- swapping ------------------------------------------------------------------------

    def offload_inputs(self) -> None:
        """Copy the region's inputs to host and drop the region's device references."""
        if not self.swap_inputs or self._input_swaps or not self._inputs:
            return
        for i, t in list(self._inputs.items()):
            if is_parameter_like(t) or not t.untyped_storage().nbytes():
                continue
            swap = SwappedStorage(t, lambda i=i: f"input {i} of checkpoint region {self.name!r}")
            self._input_swaps[i] = swap
            if self._tracker is not None:
                self._tracker.move_tensor(t, "host")
            del self._inputs[i]

    def prefetch(self) -> None:
        """Start copying back everything this region swapped (inputs and op outputs)."""
        for swap in (*self._input_swaps.values(), *self._swapped):
            swap.prefetch()

    def _input(self, index: int, meta: TensorMeta | None = None) -> torch.Tensor:
        meta = meta or self._input_meta[index]
        swap = self._input_swaps.get(index)
        if swap is not None:
            return swap.view(meta)
        tensor = self._inputs[index]
        if tensor._version != self._input_versions[index]:
            raise RuntimeError(
                f"input {index} of checkpoint region {self.name!r} was modified in place after "
                f"the region's forward (version {self._input_versions[index]} -> "
                f"{tensor._version}); its backward would use the modified values. Clone the "
                "input before modifying it."
            )
        out = torch.empty(0, dtype=meta.dtype, device=tensor.device)
        return out.set_(tensor.untyped_storage(), meta.offset, meta.size, meta.stride)

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
            return self._input(slot.index, slot.meta)
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
        leaves = list(self._leaves)
        for i, meta in self._input_meta.items():
            if i in self._input_swaps or i in self._inputs:
                leaves[i] = self._input(i).detach().requires_grad_(meta.requires_grad)
        args, kwargs = tree_unflatten(leaves, self._spec)
        for swap in self._swapped:  # everything replay may read, in one batch of copies
            swap.prefetch()
        self._results: dict[int, torch.Tensor] = {}
        self._replay_ops = self._replay_packs = self._replay_excluded = 0
        token = _CURRENT.set(self)
        self.phase = Phase.REPLAY
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self._forward_rng())
                for device_type, (enabled, dtype) in self._autocast.items():
                    stack.enter_context(torch.autocast(device_type, dtype, enabled=enabled))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(no_schedule())
                stack.enter_context(no_session())
                stack.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(self._replay_pack, _never_unpacked)
                )
                if self._size_rule is None:
                    stack.enter_context(_ReplayMode(self))
                with contextlib.suppress(_StopReplay):
                    self.fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)
            self.phase = Phase.WAITING
        missing = self._needed - self._results.keys()
        if missing:
            raise RuntimeError(
                f"recompute of checkpoint region {self.name!r} saved {self._replay_packs} "
                f"tensors where forward saved more ({len(missing)} missing): the function must "
                "run the same ops on replay (no data-dependent control flow on values that "
                "differ between forward and recompute)."
            )
        self._recomputed, self._results = self._results, {}
        self.stats.recomputes += 1
        self.stats.replayed_ops += self._replay_ops

    @contextlib.contextmanager
    def _forward_rng(self) -> Iterator[None]:
        if not self.preserve_rng_state:
            yield
            return
        cpu_now = torch.get_rng_state()
        device_now = get_device_states(*self._inputs.values()) if self._device_rng else None
        torch.set_rng_state(self._cpu_rng)
        if self._device_rng:
            set_device_states(*self._device_rng, device_type=self._device_type)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if device_now:
                set_device_states(*device_now, device_type=self._device_type)

    def replay_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Return a stored output for saved and swapped ops; run everything else."""
        index = self._replay_ops
        self._replay_ops += 1
        entry = self._cache.get(index)
        if entry is None or op_info(func).seeded:
            return func(*args, **kwargs)  # random ops always run: later ones need their draws
        out = entry.materialize()
        return func(*args, **kwargs) if out is None else out

    def replay_excluded(self) -> Any:
        """The next excluded call's stored outputs, with their forward ``requires_grad``."""
        entry = self._excluded[self._replay_excluded]
        self._replay_excluded += 1
        grads = iter(entry.requires_grad)
        return tree_map(
            lambda x: x.requires_grad_(next(grads)) if isinstance(x, torch.Tensor) else x,
            entry.materialize(),
        )

    def _replay_pack(self, tensor: torch.Tensor) -> None:
        position = self._replay_packs
        self._replay_packs += 1
        if position in self._needed:
            self.in_hook = True
            try:
                self._results[position] = tensor.detach()
            finally:
                self.in_hook = False
            if len(self._results) == len(self._needed):
                raise _StopReplay
        return None


def _recompute_all(nbytes: int) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _never_unpacked(packed: Any) -> torch.Tensor:
    raise RuntimeError("the graph built while recomputing a checkpoint region is never used")
