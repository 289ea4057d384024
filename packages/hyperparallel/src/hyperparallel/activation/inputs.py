"""A checkpointed region's inputs: held for backward and replay, optionally swapped to host.

The region keeps its tensor inputs here (never in the pytree of its call), so offloading them
drops its only device references; ``tensor(i)`` rebuilds an input from the device tensor or its
host copy, checking that it was not modified in place since forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyperparallel.activation._stored import storage_address
from hyperparallel.activation.report import ActivationTracker, is_parameter_like
from hyperparallel.activation.swap import SwappedStorage, TensorMeta


class RegionInputs:
    """The arguments of one region call, tensors tracked by their flat pytree index.

    Args:
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.
        name: the region's name, for error messages.
        tracker: the active saved-bytes tracker, told when inputs move to host.
    """

    def __init__(
        self, args: tuple, kwargs: dict, name: str, tracker: ActivationTracker | None
    ) -> None:
        self.name, self._tracker = name, tracker
        leaves, self._spec = tree_flatten((args, kwargs))
        # Non-tensor leaves only: tensors live in _tensors / _swaps.
        self._leaves: list[Any] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._tensors = {i: x for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        self._meta = {i: TensorMeta.of(x) for i, x in self._tensors.items()}
        self._versions = {i: x._version for i, x in self._tensors.items()}
        addresses = {
            i: storage_address(x) for i, x in self._tensors.items() if not is_parameter_like(x)
        }
        self._ptrs = {
            address: i
            for i, address in addresses.items()
            if address is not None and self._tensors[i].untyped_storage().nbytes()
        }
        self._swaps: dict[int, SwappedStorage] = {}

    def device_tensors(self) -> list[torch.Tensor]:
        """The inputs still referenced on device (all of them before any offload)."""
        return list(self._tensors.values())

    def index_of(self, tensor: torch.Tensor) -> int | None:
        """The input whose storage ``tensor`` uses (weights excluded), if any."""
        address = storage_address(tensor)
        return None if address is None else self._ptrs.get(address)

    @property
    def offloaded(self) -> bool:
        """Whether the inputs were copied to host."""
        return bool(self._swaps)

    def offload(self) -> None:
        """Copy the non-weight inputs to host and drop the device references."""
        if self._swaps or not self._tensors:
            return
        for i, t in list(self._tensors.items()):
            if is_parameter_like(t) or not t.untyped_storage().nbytes():
                continue
            # A function of plain values: a bound method would make a cycle (inputs -> swap ->
            # inputs) that keeps the pinned host buffer from the pool until a gc run.
            swap = SwappedStorage(t, functools.partial(_describe_input, self.name, i))
            self._swaps[i] = swap
            if self._tracker is not None:
                self._tracker.move_tensor(t, "host")
            del self._tensors[i]

    def release(self) -> None:
        """Drop the device references: nothing will read the inputs again."""
        self._tensors.clear()

    def prefetch(self) -> None:
        """Start copying the offloaded inputs back."""
        for swap in self._swaps.values():
            swap.prefetch()

    def tensor(self, index: int, meta: TensorMeta | None = None) -> torch.Tensor:
        """Input ``index`` (or the view ``meta`` of its storage), from device or host.

        Raises:
            RuntimeError: the input was modified in place after the region's forward.
        """
        meta = meta or self._meta[index]
        swap = self._swaps.get(index)
        if swap is not None:
            return swap.view(meta)
        tensor = self._tensors[index]
        if tensor._version != self._versions[index]:
            raise RuntimeError(
                f"input {index} of checkpoint region {self.name!r} was modified in place after "
                f"the region's forward (version {self._versions[index]} -> "
                f"{tensor._version}); its backward would use the modified values. Clone the "
                "input before modifying it."
            )
        out = torch.empty(0, dtype=meta.dtype, device=tensor.device)
        return out.set_(tensor.untyped_storage(), meta.offset, meta.size, meta.stride)

    def call_for_replay(self) -> tuple[tuple, dict]:
        """(args, kwargs) for the replay: inputs detached, with their forward requires_grad."""
        leaves = list(self._leaves)
        for i, meta in self._meta.items():
            if i in self._swaps or i in self._tensors:
                leaves[i] = self.tensor(i).detach().requires_grad_(meta.requires_grad)
        args, kwargs = tree_unflatten(leaves, self._spec)
        return args, kwargs


def _describe_input(region: str, index: int) -> str:
    """Names an input in the error raised when it is modified after the offload."""
    return f"input {index} of checkpoint region {region!r}"
