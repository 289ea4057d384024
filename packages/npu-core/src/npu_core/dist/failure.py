"""One line for a failed rank: which rank, what happened, and where its traceback was kept.

A multi-rank job that fails reaches the user as an exception with a remote traceback of 70-200
lines, most of it the launcher's and torch's frames, and the cause (out of memory, a full disk,
a signal) somewhere inside. CLIs turn it into :class:`RankFailure`: the rank, the cause in a
few words, and the full text, which they write to a log file that the one line points to.
"""

from __future__ import annotations

import errno
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from npu_core import env
from npu_core.dist.launch import (
    LaunchTimeoutError,
    RankExitedError,
    RankStoppedError,
    RemoteTraceback,
)

_CPU_ALLOCATOR_FAILED = "can't allocate memory"
"""What ATen's CPU allocator says when the operating system refuses an allocation."""


@dataclass(frozen=True)
class RankFailure:
    """A failed rank, described for a person.

    Attributes:
        rank: the rank that failed first, or None when no single rank is known (a timeout).
        cause: a few words, e.g. ``"out of memory (...)"``, ``"killed by SIGKILL"``.
        details: the full traceback (the rank's own one when it came from a rank).
    """

    rank: int | None
    cause: str
    details: str

    def line(self, log: Path | None = None) -> str:
        """The one line a CLI prints: ``rank 1: killed by SIGKILL (traceback in LOG)``."""
        where = f"rank {self.rank}: " if self.rank is not None else ""
        kept = f" (traceback in {log})" if log is not None else ""
        return f"{where}{self.cause}{kept}"

    def write(self, folder: Path) -> Path:
        """Keep :attr:`details` in ``folder/rank<N>.log`` (``launcher.log`` without a rank)."""
        name = f"rank{self.rank}.log" if self.rank is not None else "launcher.log"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(self.details)
        return path


def describe(exc: BaseException) -> RankFailure:
    """Name the failing rank and the cause of ``exc``, as raised by a launch or by a rank itself.

    Exceptions re-raised by :func:`~npu_core.dist.launch` carry the rank's traceback as their
    ``__cause__``; an exception raised in this process (a rank under torchrun) belongs to this
    process's rank.
    """
    details = "".join(traceback.format_exception(exc))
    if isinstance(exc, RankExitedError):
        return RankFailure(exc.rank, _exit_cause(exc.exitcode), details)
    if isinstance(exc, RankStoppedError):
        return RankFailure(
            exc.rank,
            "stopped (SIGSTOP, SIGTSTP or a debugger); its peers timed out waiting for it",
            details,
        )
    if isinstance(exc, LaunchTimeoutError):
        return RankFailure(None, str(exc), details)
    remote = exc.__cause__
    if isinstance(remote, RemoteTraceback):
        return RankFailure(remote.rank, _error_cause(exc), remote.args[0].lstrip("\n"))
    rank = env.launch_rank() if env.torchrun_environment() else None
    return RankFailure(rank, _error_cause(exc), details)


def _exit_cause(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        if -exitcode == signal.SIGKILL:
            return f"killed by {name} (by a user, or by the kernel when memory ran out)"
        return f"killed by {name}"
    return f"exited with code {exitcode} without reporting a result"


def _error_cause(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError | MemoryError) or _CPU_ALLOCATOR_FAILED in str(exc):
        return f"out of memory ({first_line})" if first_line else "out of memory"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f": {exc.filename}" if exc.filename else ""
        return f"no space left on the device{where}"
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
