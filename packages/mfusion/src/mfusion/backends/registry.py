"""Kernel backends as registered plug-ins (``npu_core.plugins``), chosen by the workspace's one
rule and logged.

Each backend declares where it runs (its constraints) and whether it can run in this process
(its ``installed`` probe: torch-mlir's JIT importable, torch_npu seeing a device). ``auto`` takes
the first installed backend in priority order that accepts the machine's device: ``npu`` where
torch_npu sees a device, else ``inductor``. ``mlir-cpu`` is never chosen automatically (it
outlines a region only where measured faster than Inductor's kernel, but each first decision
costs an Inductor compile of the region and its JIT compile); naming a backend forces it, and
a forced backend that cannot run here is an error naming why, never a silent fallback.

This module is data plus the registry: implementations are ``"module:Class"`` strings imported on
first use, so importing it (from the config, which validates names) initialises no device and
imports no backend code.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import TYPE_CHECKING

from npu_core import detect_backend
from npu_core.plugins import DeviceDtype, Plugin, PluginError, Registry

if TYPE_CHECKING:
    from mfusion.backends.base import KernelBackend


class BackendName(enum.StrEnum):
    """Kernel backends a fused region can be handed to (``auto``: chosen by the rule above)."""

    AUTO = "auto"
    INDUCTOR = "inductor"
    MLIR_CPU = "mlir-cpu"
    NPU = "npu"


@dataclasses.dataclass(frozen=True)
class BackendCall:
    """What a backend is chosen for: the device type the compiled graphs run on."""

    device: str
    dtype: None = None  # a backend takes every dtype its capability table plans for


def _mlir_installed() -> str | None:
    try:
        import torch_mlir.execution_engine  # noqa: F401
    except ImportError as error:
        return f"torch_mlir.execution_engine does not import ({error})"
    return None


def _npu_installed() -> str | None:
    return None if detect_backend().value == "npu" else "torch_npu sees no Ascend device"


BACKENDS: Registry[str, BackendCall] = Registry("mfusion kernel backend")
BACKENDS.register(
    Plugin(
        name=BackendName.NPU.value,
        impl="mfusion.backends.npu:NPUBackend",
        constraints=DeviceDtype(devices=("npu",)),
        installed=_npu_installed,
        priority=10,
    )
)
BACKENDS.register(
    Plugin(
        name=BackendName.INDUCTOR.value,
        impl="mfusion.backends.inductor:InductorBackend",
        constraints=DeviceDtype(),
        priority=20,
    )
)
BACKENDS.register(
    Plugin(
        name=BackendName.MLIR_CPU.value,
        impl="mfusion.backends.mlir_cpu:MLIRCPUBackend",
        constraints=DeviceDtype(),
        installed=_mlir_installed,
        priority=90,  # only when forced: its measured per-region choice costs compile time
    )
)
BACKEND_REGISTRY: dict[str, str] = {name: BACKENDS.get(name).impl for name in BACKENDS.names()}
"""Backend name -> ``"module:Class"``, in preference order (read-only view of :data:`BACKENDS`)."""


def _known(name: BackendName | str) -> str:
    try:
        value = BackendName(name).value
    except ValueError:
        value = str(name)
    if value not in BACKEND_REGISTRY:
        raise ValueError(
            f"backend {name!r} is not known; use one of {sorted(BACKEND_REGISTRY)} or 'auto'"
        )
    return value


def select_backend(name: BackendName | str = BackendName.AUTO) -> BackendName:
    """The backend for this machine: ``auto`` by the plug-in rule, a named one if it can run.

    Raises:
        ValueError: ``name`` is unknown.
        PluginError: (a ``ValueError``) the named backend cannot run here; says why.
    """
    call = BackendCall(device=detect_backend().value)
    forced = None if BackendName(name) is BackendName.AUTO else _known(name)
    return BackendName(BACKENDS.select(call, forced=forced).name)


def backend_class(name: BackendName | str) -> type[KernelBackend]:
    """The class registered under ``name`` (imported now; nothing is probed)."""
    module, attr = BACKEND_REGISTRY[_known(name)].split(":")
    # what the registry promises; not checked here, since this module imports no backend code
    cls: type[KernelBackend] = getattr(importlib.import_module(module), attr)
    return cls


def get_backend(name: BackendName | str) -> KernelBackend:
    """An instance of the named backend.

    Raises:
        PluginError: The backend cannot run here (e.g. ``npu`` without torch_npu); the message
            says why.
    """
    return backend_class(select_backend(name))()


__all__ = [
    "BACKENDS",
    "BACKEND_REGISTRY",
    "BackendCall",
    "BackendName",
    "PluginError",
    "backend_class",
    "get_backend",
    "select_backend",
]
