"""Count the torch.distributed collectives a process issues: kind, process group, bytes.

Every collective, whichever API issued it, reaches the dispatcher as a ``c10d`` op (eager
``torch.distributed.*`` calls, P2P and ``batch_isend_irecv`` included) or a ``_c10d_functional``
op (the functional collectives DTensor and compiled code use). A ``TorchDispatchMode`` sees both,
so the count does not depend on how a library imported its collectives. Naming a process group
after a mesh dimension is left to the caller, who knows the mesh.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:  # a type only: torch 2.9, the floor, does not define it
    from torch.distributed.distributed_c10d import GroupName

OBJECT = "object"
"""Kind of every collective issued inside a ``*_object`` / ``*_object_list`` call of torch."""

_OBJECT_FUNCTIONS = frozenset(
    {
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)

# op name -> (kind, the schema argument whose tensors this rank passes in)
_OPS: dict[str, tuple[str, str]] = {
    "c10d::_allgather_base_": ("all_gather", "input_tensor"),
    "c10d::allgather_": ("all_gather", "input_tensors"),
    "c10d::allgather_coalesced_": ("all_gather", "input_list"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "c10d::allreduce_": ("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors"),
    "c10d::alltoall_base_": ("all_to_all", "input"),
    "c10d::alltoall_": ("all_to_all", "input_tensors"),
    "c10d::broadcast_": ("broadcast", "tensors"),
    "c10d::reduce_": ("reduce", "tensors"),
    "c10d::gather_": ("gather", "input_tensors"),
    "c10d::gather_into_tensor_": ("gather", "input_tensor"),
    "c10d::scatter_": ("scatter", "input_tensors"),
    "c10d::send": ("send", "tensors"),
    "c10d::recv_": ("recv", "tensors"),
    "c10d::recv_any_source_": ("recv", "tensors"),
    "c10d::barrier": ("barrier", ""),
    "c10d::monitored_barrier_": ("barrier", ""),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "_c10d_functional::all_reduce": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input"),
    "_c10d_functional::broadcast": ("broadcast", "input"),
    "_c10d_functional::broadcast_": ("broadcast", "input"),
    "_c10d_functional::isend": ("send", "tensor"),
    "_c10d_functional::irecv": ("recv", "tensor"),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", "input"),
}
_PEER_ARGUMENT = {"send": ("dst",), "recv": ("src",)}


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as this rank issued it."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``,
    ``reduce``, ``gather``, ``scatter``, ``send``, ``recv``, ``barrier``, or ``object`` for any
    collective run by one of torch's object collectives (``all_gather_object``, ...)."""
    op: str
    """The dispatcher op, e.g. ``c10d::_allgather_base_``."""
    group: tuple[int, ...]
    """Global ranks of the process group, in group-rank order."""
    bytes: int
    """Bytes of the tensors this rank passes in: an all-gather's input shard, a
    reduce-scatter's full input, an all-reduce's or broadcast's tensor, an all-to-all's input,
    the sent tensor, the receive buffer; 0 for a barrier."""
    peer: int | None = None
    """Global rank of the other side of a point-to-point op; None for collectives."""


@dataclass(frozen=True)
class CollectiveTotal:
    """Calls and bytes summed over the calls of one kind on one process group."""

    calls: int
    bytes: int


@dataclass
class CollectiveLog:
    """The collectives recorded by one ``count_collectives`` block, in issue order."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def totals(self) -> dict[tuple[str, tuple[int, ...]], CollectiveTotal]:
        """Calls and bytes per (kind, group ranks), every recorded call counted once."""
        sums: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
        for call in self.calls:
            calls, nbytes = sums.get((call.kind, call.group), (0, 0))
            sums[(call.kind, call.group)] = (calls + 1, nbytes + call.bytes)
        return {key: CollectiveTotal(calls, nbytes) for key, (calls, nbytes) in sums.items()}


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every torch.distributed collective this thread issues inside the block.

    Collectives run as they would without the block; each one also appends a
    ``CollectiveCall`` to the yielded log. Autograd's backward runs in the calling thread's
    dispatch state, so collectives issued from hooks and backward functions are counted too;
    collectives issued from a thread started by the caller are not.

    Yields:
        The log, filled while the block runs.
    """
    log = CollectiveLog()
    with _CountingMode(log):
        yield log


# TorchDispatchMode has no annotations: mypy reads its subclassing and __init__ as untyped calls
class _CountingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Appends a ``CollectiveCall`` for each collective op that reaches the dispatcher."""

    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._log = log

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # DTensor first turns the op into ops on local tensors, its redistributions'
            # collectives among them, which then come back here. Other subclasses (FakeTensor
            # in DTensor's sharding propagation) issue no collective and run as they are.
            return NotImplemented
        entry = _OPS.get(getattr(func, "name", lambda: "")())
        if entry is not None:
            self._log.calls.append(_describe(func, entry, args, kwargs))
        return func(*args, **kwargs)


def _describe(
    func: Any, entry: tuple[str, str], args: Sequence[Any], kwargs: dict[str, Any]
) -> CollectiveCall:
    kind, tensors_argument = entry
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
    group = _group(bound)
    ranks = tuple(dist.get_process_group_ranks(group))
    peer = next((bound[n] for n in _PEER_ARGUMENT.get(kind, ()) if n in bound), None)
    return CollectiveCall(
        kind=OBJECT if _inside_object_collective() else kind,
        op=func.name(),
        group=ranks,
        bytes=_nbytes(bound[tensors_argument]) if tensors_argument else 0,
        peer=None if peer is None else ranks[peer],
    )


def _group(bound: dict[str, Any]) -> dist.ProcessGroup:
    """The ProcessGroup of a c10d op (a boxed object) or of a functional op (a name or boxed)."""
    value = bound["process_group"] if "process_group" in bound else bound["group_name"]
    if isinstance(value, str):
        return dist.distributed_c10d._resolve_process_group(cast("GroupName", value))
    if isinstance(value, dist.ProcessGroup):
        return value
    return dist.ProcessGroup.unbox(value)


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(item) for item in value)


def _inside_object_collective() -> bool:
    """Whether the current call runs inside one of torch's object collectives.

    They pickle objects into byte tensors and exchange sizes first; their tensor collectives
    are start-up or checkpointing traffic, not a training step's, so they get their own kind.
    The call stack is the one place that knows, whichever module imported the function.
    """
    c10d_file = dist.distributed_c10d.__file__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _OBJECT_FUNCTIONS and code.co_filename == c10d_file:
            return True
        frame = frame.f_back
    return False
