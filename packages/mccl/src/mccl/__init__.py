"""mccl: initialise torch.distributed in the background and wait for it at first use."""

from importlib.metadata import version

from mccl._worker import GroupFuture
from mccl.api import InitHandle, init_process_group, is_ready, new_group, wait
from mccl.errors import InitTimeoutError, MCCLError

__version__ = version("torchmind-mccl")

__all__ = [
    "GroupFuture",
    "InitHandle",
    "InitTimeoutError",
    "MCCLError",
    "__version__",
    "init_process_group",
    "is_ready",
    "new_group",
    "wait",
]
