"""Which accelerator this process uses, and which collective backend goes with it.

Detection order: Ascend NPU (torch_npu importable and a device visible), then CUDA, then CPU.
``NPU_CORE_BACKEND`` / ``NPU_CORE_COMM_BACKEND`` override the result.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from npu_core import env
from npu_core.npu import import_torch_npu, npu_device_count


class Backend(enum.StrEnum):
    """Compute backends, named as torch names their device type."""

    NPU = "npu"
    CUDA = "cuda"
    CPU = "cpu"


class CommBackend(enum.StrEnum):
    """torch.distributed backends, one per compute backend."""

    HCCL = "hccl"
    NCCL = "nccl"
    GLOO = "gloo"


_COMM_FOR = {
    Backend.NPU: CommBackend.HCCL,
    Backend.CUDA: CommBackend.NCCL,
    Backend.CPU: CommBackend.GLOO,
}


_E = TypeVar("_E", bound=enum.StrEnum)


def _parse(enum_type: type[_E], value: str, source: str) -> _E:
    try:
        return enum_type(value.lower())
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise ValueError(
            f"{source}={value!r} is not a valid choice; use one of: {allowed}"
        ) from None


def detect_backend() -> Backend:
    """Return the compute backend of this process.

    ``NPU_CORE_BACKEND`` wins when set; an override naming a backend that is not usable here
    raises instead of failing later inside a kernel.
    """
    forced = env.read(env.BACKEND)
    if forced is not None:
        backend = _parse(Backend, forced, env.BACKEND)
        if not is_available(backend):
            raise RuntimeError(f"{env.BACKEND}={forced} but no {backend} device is visible here")
        return backend
    if npu_device_count() > 0:
        return Backend.NPU
    if torch.cuda.is_available():
        return Backend.CUDA
    return Backend.CPU


def is_available(backend: Backend | str) -> bool:
    """Whether ``backend`` has a usable device in this process."""
    backend = Backend(backend)
    if backend is Backend.NPU:
        return npu_device_count() > 0
    if backend is Backend.CUDA:
        return torch.cuda.is_available()
    return True


def comm_backend(backend: Backend | str | None = None) -> CommBackend:
    """Collective backend for ``backend`` (default: the detected one): hccl, nccl or gloo.

    ``NPU_CORE_COMM_BACKEND`` overrides, e.g. ``gloo`` to run CPU collectives on a GPU machine.
    """
    forced = env.read(env.COMM_BACKEND)
    if forced is not None:
        return _parse(CommBackend, forced, env.COMM_BACKEND)
    return _COMM_FOR[Backend(backend) if backend is not None else detect_backend()]


def check_comm_backend(name: str) -> None:
    """Raise ValueError unless the collective backend ``name`` can run in this process.

    Checked before any rank starts: a backend that is unknown, not built into this torch, or
    without its device (nccl without a CUDA device) would otherwise fail inside every rank.
    """
    known = ", ".join(member.value for member in CommBackend)
    try:
        backend = CommBackend(name)
    except ValueError:
        raise ValueError(f"unknown collective backend {name!r}; use one of: {known}") from None
    if not _comm_usable(backend):
        usable = ", ".join(b.value for b in CommBackend if _comm_usable(b))
        device = {value: key for key, value in _COMM_FOR.items()}[backend]
        raise ValueError(
            f"collective backend {name!r} cannot run here (no {device} device, or not built "
            f"into this torch); usable here: {usable}"
        )


def _comm_usable(backend: CommBackend) -> bool:
    if backend is CommBackend.GLOO:
        return torch.distributed.is_gloo_available()
    if backend is CommBackend.NCCL:
        return torch.distributed.is_nccl_available() and is_available(Backend.CUDA)
    return is_available(Backend.NPU)  # hccl: torch_npu registers it with its devices


def device_module(backend: Backend | str | None = None) -> ModuleType | None:
    """``torch.npu`` or ``torch.cuda`` for an accelerator backend, None for the CPU."""
    backend = Backend(backend) if backend is not None else detect_backend()
    if backend is Backend.NPU:
        import_torch_npu()
        return torch.npu  # type: ignore[attr-defined,no-any-return]  # added by torch_npu
    if backend is Backend.CUDA:
        return torch.cuda
    return None


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (a no-op on the CPU and unknown types).

    Timings must call it before reading the clock: accelerator kernels run asynchronously.
    """
    kind = torch.device(device).type
    module = device_module(kind) if kind in {b.value for b in Backend} else None
    return (lambda: None) if module is None else module.synchronize


def device_for_rank(local_rank: int = 0, backend: Backend | str | None = None) -> torch.device:
    """The device a rank should use: ``npu:i`` / ``cuda:i`` (i = local rank modulo count) or cpu."""
    backend = Backend(backend) if backend is not None else detect_backend()
    module = device_module(backend)
    if module is None:
        return torch.device("cpu")
    return torch.device(backend.value, local_rank % module.device_count())
