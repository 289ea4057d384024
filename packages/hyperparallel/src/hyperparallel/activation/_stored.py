"""What a checkpointed region keeps for backward: one slot per saved tensor, the stored outputs
of saved and swapped ops (for replay), and the facts about an op's schema the region needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hyperparallel.activation.policy import CheckpointPolicy
from hyperparallel.activation.report import storage_owner
from hyperparallel.activation.swap import SwappedStorage, TensorMeta

StorageAddress = tuple[torch.device, int]


def storage_address(tensor: torch.Tensor) -> StorageAddress | None:
    """Where ``tensor``'s data lives: the address of its storage, or of the one tensor a wrapper
    subclass (an in-flight collective's result, a DTensor) wraps. None for a wrapper of several
    tensors: nothing names it, so it is kept as is."""
    owner = storage_owner(tensor)
    if owner is None:
        return None
    return owner.device, owner.untyped_storage().data_ptr()


@dataclass(frozen=True)
class OpInfo:
    """What the region needs from an op's schema, computed once per op."""

    returns_alias: bool  # views and in-place ops: their outputs reuse an input's storage
    mutated: tuple[tuple[int, str], ...]  # (position, name) of arguments written in place
    seeded: bool  # draws random numbers


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        schema = func._schema
        info = _OP_INFO[func] = OpInfo(
            returns_alias=any(r.alias_info is not None for r in schema.returns),
            mutated=tuple(
                (i, a.name)
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            ),
            seeded=torch.Tag.nondeterministic_seeded in func.tags,
        )
    return info


def mutated_args(info: OpInfo, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an op writes to (in-place and out= arguments)."""
    found = []
    for i, name in info.mutated:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


def tensors_of(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(not isinstance(x, (tuple, list, dict)) for x in out):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


@dataclass
class OpRecord:
    index: int
    op: Any  # the OpOverload
    policy: CheckpointPolicy
    swaps: dict[StorageAddress, SwappedStorage] = field(default_factory=dict)


@dataclass
class Keep:
    """A saved tensor kept as is; its version is checked at unpack."""

    tensor: torch.Tensor
    version: int
    what: Callable[[], str]  # built only for an error message


@dataclass
class SwapSlot:
    storage: SwappedStorage
    meta: TensorMeta


@dataclass
class InputSlot:
    index: int
    meta: TensorMeta


@dataclass
class RecomputeSlot:
    position: int


class SavedOutputs:
    """Outputs of a saved op (or an excluded call), for replay: detached aliases that share the
    originals' version counters."""

    def __init__(self, out: Any, record: OpRecord | None, region: str) -> None:
        tensors = tensors_of(out)
        self.requires_grad = [t.requires_grad for t in tensors]
        self.out = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
        self.versions = [t._version for t in tensors]
        self.record, self.region = record, region

    def tensors(self) -> list[torch.Tensor]:
        return tensors_of(self.out)

    def materialize(self) -> Any:
        for t, version in zip(self.tensors(), self.versions, strict=True):
            if t._version != version:
                what = "output of an excluded call"
                if self.record is not None:
                    what = f"output of {self.record.op} (op {self.record.index})"
                raise RuntimeError(
                    f"{what} in checkpoint region {self.region!r} was saved for backward and then "
                    f"modified in place (version {version} -> {t._version}); recompute would "
                    "read the modified values. Clone it before modifying it."
                )
        return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, self.out)


class SwappedOutputs:
    """Outputs of a swapped op, for replay: each output's layout, and its host copy once backward
    saved it (swaps start at the first pack, so only tensors backward needs are copied)."""

    def __init__(self, out: Any, record: OpRecord) -> None:
        leaves, self.spec = tree_flatten(out)
        self.record = record
        self.leaves = [
            (storage_address(x), TensorMeta.of(x)) if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]

    def materialize(self) -> Any:
        """The outputs rebuilt from host copies, or None when one was never swapped."""
        swaps = self.record.swaps
        leaves = []
        for leaf in self.leaves:
            if isinstance(leaf, tuple) and isinstance(leaf[1], TensorMeta):
                if leaf[0] not in swaps:
                    return None  # never saved for backward: replay runs the op instead
                leaf = swaps[leaf[0]].view(leaf[1])
            leaves.append(leaf)
        return tree_unflatten(leaves, self.spec)
