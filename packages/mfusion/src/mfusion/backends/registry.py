"""Backend names -> implementing classes (lazy "module:Class" strings; importing initialises no
device)."""

from __future__ import annotations

import importlib

from mfusion.backends.base import KernelBackend
from mfusion.config import BackendName

BACKEND_REGISTRY: dict[str, str] = {
    BackendName.INDUCTOR: "mfusion.backends.inductor:InductorBackend",
    BackendName.MLIR_CPU: "mfusion.backends.mlir_cpu:MLIRCPUBackend",
    BackendName.NPU: "mfusion.backends.npu:NPUBackend",
}


def backend_class(name: BackendName | str) -> type[KernelBackend]:
    try:
        location = BACKEND_REGISTRY[BackendName(name)]
    except (KeyError, ValueError):
        raise ValueError(
            f"backend {name!r} is not known; use one of {sorted(BACKEND_REGISTRY)}"
        ) from None
    module, attr = location.split(":")
    return getattr(importlib.import_module(module), attr)


def get_backend(name: BackendName | str) -> KernelBackend:
    """An instance of the named backend.

    Raises:
        RuntimeError: The backend cannot run here (e.g. ``npu`` without torch_npu).
    """
    cls = backend_class(name)
    if not cls.is_available():
        raise RuntimeError(f"backend {name!r} is not available on this machine")
    return cls()
