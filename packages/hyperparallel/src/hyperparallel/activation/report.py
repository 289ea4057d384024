"""An exact count of saved-activation bytes by placement: on device, on host, recomputed.

Counting is by storage (two views of one tensor count once) from the saved-tensor hooks' own
bookkeeping, not from allocator statistics: on a CPU-only machine "device" and "host" are the
same memory, so only this accounting can say where each byte would live on an accelerator.
Parameters (leaf tensors that require grad, and views of them) are weights, not activations, and
are not counted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Hashable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

Placement = Literal["device", "host", "recomputed"]
PLACEMENTS: tuple[Placement, ...] = ("device", "host", "recomputed")


@dataclass(frozen=True)
class ActivationReport:
    """Saved-activation bytes of one forward pass, by where they wait for backward.

    Attributes:
        device_bytes: kept on the device (saved tensors outside checkpointed regions, region
            inputs, outputs a policy saves).
        host_bytes: swapped to (pinned) host memory.
        recomputed_bytes: dropped after forward and recomputed for backward.
        regions: checkpointed regions that ran.
    """

    device_bytes: int
    host_bytes: int
    recomputed_bytes: int
    regions: int

    @property
    def total_bytes(self) -> int:
        """Everything backward needs, wherever it waits."""
        return self.device_bytes + self.host_bytes + self.recomputed_bytes

    def to_dict(self) -> dict[str, int]:
        """Plain numbers, for JSON metrics."""
        return asdict(self)


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """A leaf that requires grad (a weight), or a view of one."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def storage_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose own storages hold ``tensor``'s data: itself, or the tensors it wraps.

    A wrapper subclass (a functional collective's in-flight result, a DTensor) has a storage
    object with no memory behind it, whose data pointer cannot be read: its data lives in the
    tensors it wraps, whose storages are the ones to key by and count.
    """
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    inner, _ = tensor.__tensor_flatten__()
    return [t for name in inner for t in storage_tensors(getattr(tensor, name))]


def storage_owner(tensor: torch.Tensor) -> torch.Tensor | None:
    """The one tensor whose storage holds ``tensor``'s data; None for a wrapper of several."""
    owners = storage_tensors(tensor)
    return owners[0] if len(owners) == 1 else None


def storage_key(tensor: torch.Tensor) -> tuple[Hashable, int]:
    """(identity of ``tensor``'s storage while it lives, its size in bytes)."""
    storage = tensor.untyped_storage()
    return ("storage", tensor.device, storage.data_ptr()), storage.nbytes()


class ActivationTracker:
    """Collects saved activations during forward; :meth:`report` sums them by placement.

    Use as a context manager around the forward pass. Saved tensors outside checkpointed
    regions are seen through a saved-tensor hook (placement ``outside``); regions add their
    own entries. The hook delegates to hooks already active (e.g. ``save_on_cpu``), so it can
    measure them too.
    """

    def __init__(self, outside: Placement = "device") -> None:
        self.outside: Placement = outside
        self._bytes: dict[Hashable, tuple[int, Placement]] = {}
        # storage address -> (weak ref, the key counted for it): a freed storage's address can
        # be reused by a new one, which must count as a new entry.
        self._live: dict[Hashable, tuple[StorageWeakRef, Hashable]] = {}
        self._generation = 0
        self.regions = 0
        self._stack: contextlib.ExitStack | None = None

    def add(self, key: Hashable, nbytes: int, placement: Placement) -> None:
        """Count ``nbytes`` under ``placement`` once per ``key`` (the first placement wins)."""
        self._bytes.setdefault(key, (nbytes, placement))

    def _key(self, tensor: torch.Tensor) -> tuple[Hashable, int]:
        address, nbytes = storage_key(tensor)
        live = self._live.get(address)
        if live is None or live[0].expired():
            self._generation += 1
            live = (StorageWeakRef(tensor.untyped_storage()), (address, self._generation))
            self._live[address] = live
        return live[1], nbytes

    def add_tensor(self, tensor: torch.Tensor, placement: Placement) -> None:
        """Count ``tensor``'s storage, unless it is a parameter."""
        if not is_parameter_like(tensor):
            for owner in storage_tensors(tensor):
                key, nbytes = self._key(owner)
                self.add(key, nbytes, placement)

    def move_tensor(self, tensor: torch.Tensor, placement: Placement) -> None:
        """Count ``tensor``'s (live) storage under ``placement`` from now on (e.g. an input
        swapped to host)."""
        if not is_parameter_like(tensor):
            for owner in storage_tensors(tensor):
                key, nbytes = self._key(owner)
                self._bytes[key] = (nbytes, placement)

    def report(self) -> ActivationReport:
        """Totals so far."""
        sums = dict.fromkeys(PLACEMENTS, 0)
        for nbytes, placement in self._bytes.values():
            sums[placement] += nbytes
        return ActivationReport(sums["device"], sums["host"], sums["recomputed"], self.regions)

    def __enter__(self) -> ActivationTracker:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_use(self))
        self._stack.enter_context(tap_saved_tensors(self, self.outside))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()


@contextlib.contextmanager
def tap_saved_tensors(tracker: ActivationTracker, placement: Placement) -> Iterator[None]:
    """Count every tensor autograd saves in this block, then hand it to the enclosing hooks."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)

    if top is None:

        def pack(tensor: torch.Tensor) -> object:
            tracker.add_tensor(tensor, placement)
            return tensor, tensor._version

        def unpack(packed: Any) -> torch.Tensor:  # (tensor, version) from pack
            # Hooks switch off autograd's own check that a saved tensor was not modified.
            tensor, version = packed
            if tensor._version != version:
                raise RuntimeError(
                    f"a tensor of shape {tuple(tensor.shape)} saved for backward was modified in "
                    f"place afterwards (version {version} -> {tensor._version}); backward would "
                    "use the modified values. Clone it before modifying it."
                )
            return tensor

    else:
        outer_pack, outer_unpack = top

        def pack(tensor: torch.Tensor) -> object:
            tracker.add_tensor(tensor, placement)
            return outer_pack(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            return outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


_TRACKER: contextvars.ContextVar[ActivationTracker | None] = contextvars.ContextVar(
    "hyperparallel_activation_tracker", default=None
)


@contextlib.contextmanager
def _use(tracker: ActivationTracker) -> Iterator[None]:
    token = _TRACKER.set(tracker)
    try:
        yield
    finally:
        _TRACKER.reset(token)


def current_tracker() -> ActivationTracker | None:
    """The :class:`ActivationTracker` active in this context, if any."""
    return _TRACKER.get()


def track_saved_activations() -> ActivationTracker:
    """``with track_saved_activations() as t: loss = model(x)`` then ``t.report()``."""
    return ActivationTracker()
