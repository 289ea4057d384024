"""Multi-rank helpers: a local launcher with timeouts and remote tracebacks, and torchrun entry."""

from npu_core.dist.entry import is_torchrun, run
from npu_core.dist.launch import (
    LOOPBACK,
    LaunchTimeoutError,
    RankExitedError,
    RankFailedError,
    RankStoppedError,
    RemoteTraceback,
    find_free_port,
    launch,
)

__all__ = [
    "LOOPBACK",
    "LaunchTimeoutError",
    "RankExitedError",
    "RankFailedError",
    "RankStoppedError",
    "RemoteTraceback",
    "find_free_port",
    "is_torchrun",
    "launch",
    "run",
]
