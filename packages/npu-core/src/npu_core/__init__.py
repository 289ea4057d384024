"""npu-core: the device, stream, memory, launcher and benchmark helpers every package shares."""

from importlib.metadata import version

from npu_core.device import (
    Backend,
    CommBackend,
    comm_backend,
    detect_backend,
    device_for_rank,
    device_module,
    is_available,
)

__version__ = version("torchmind-npu-core")

__all__ = [
    "Backend",
    "CommBackend",
    "__version__",
    "comm_backend",
    "detect_backend",
    "device_for_rank",
    "device_module",
    "is_available",
]
