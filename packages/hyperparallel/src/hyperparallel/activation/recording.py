"""Forward observation of a region: which op made each storage and what the policy decided.

A ``TorchDispatchMode`` hands every op the region's function issues to an :class:`OpRecorder`,
which asks the policy about ops that allocate new tensors, keeps saved and swapped ops' outputs
for replay, and demotes a stored output to recompute when a later op modifies it in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from hyperparallel.activation._stored import (
    OpRecord,
    SavedOutputs,
    SwappedOutputs,
    mutated_args,
    op_info,
    storage_address,
    tensors_of,
)
from hyperparallel.activation.policy import CheckpointPolicy, PolicyContext, PolicyFn
from hyperparallel.activation.report import storage_owner


class OpRecorder:
    """Per-op decisions of one region's forward, and who produced each storage.

    Args:
        name: the region's name (policy context and error messages).
        policy_fn: the region's per-op policy, or None (recompute everything).
    """

    def __init__(self, name: str, policy_fn: PolicyFn | None) -> None:
        self.name, self.policy_fn = name, policy_fn
        # storage address -> (weak ref to that storage, the op that allocated it); the weak ref
        # tells a live storage from a freed one whose address was reused.
        self._produced: dict[tuple[torch.device, int], tuple[StorageWeakRef, OpRecord]] = {}
        self.cache: dict[int, SavedOutputs | SwappedOutputs] = {}
        """Op index -> stored outputs of saved and swapped ops, for replay."""
        self._op_count = 0

    def record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Ask the policy about ``func``'s new outputs; note who made each storage."""
        index = self._op_count
        self._op_count += 1
        info = op_info(func)
        if info.mutated:
            for written in mutated_args(info, args, kwargs):
                self._demote(self.producer(written), func)
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
            self.cache[index] = SavedOutputs(out, record, self.name)
        elif choice.is_swap:
            self.cache[index] = SwappedOutputs(out, record)
        for t in fresh:
            self.record_saved(t, record)

    def record_saved(self, tensor: torch.Tensor, record: OpRecord) -> None:
        """Note ``record`` as the producer of ``tensor``'s storage (the one its data lives in)."""
        owner = storage_owner(tensor)
        if owner is not None:
            address = storage_address(owner)
            assert address is not None
            self._produced[address] = (StorageWeakRef(owner.untyped_storage()), record)

    def producer(self, tensor: torch.Tensor) -> OpRecord | None:
        """The region op that allocated ``tensor``'s storage, if the storage is still that one."""
        address = storage_address(tensor)
        entry = None if address is None else self._produced.get(address)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def forget_unsaved_swaps(self) -> None:
        """Drop swapped ops none of whose outputs was saved: replay runs them instead."""
        for index, entry in list(self.cache.items()):
            if isinstance(entry, SwappedOutputs) and not entry.record.swaps:
                del self.cache[index]

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
        self.cache.pop(record.index, None)
        record.swaps = {}


class ForwardMode(TorchDispatchMode):
    """Runs every op and reports it to the recorder unless ``skip()`` says not to (inside an
    excluded call, or an op issued by the region's own saved-tensor hooks)."""

    def __init__(self, recorder: OpRecorder, skip: Callable[[], bool]) -> None:
        super().__init__()
        self.recorder, self.skip = recorder, skip

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.skip():
            self.recorder.record_op(func, args, kwargs, out)
        return out
