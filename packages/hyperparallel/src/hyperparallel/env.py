"""Environment variables read by hyperparallel, in one place (read when asked, never at import).

Only the process-placement variables that torchrun and the npu-core launcher set are read; every
setting of a run is a configuration field instead (``--set``), so a run is reproducible from its
``metrics.json``.
"""

from __future__ import annotations

import os

RANK = "RANK"
"""Global rank of this process (torchrun / npu-core launcher); unset means a single process."""

LOCAL_RANK = "LOCAL_RANK"
"""Rank on this node; chooses the accelerator index."""


def rank() -> int:
    """This process's global rank, 0 outside a distributed launch."""
    return int(os.environ.get(RANK, "0"))


def local_rank() -> int:
    """This process's rank on its node, 0 outside a distributed launch."""
    return int(os.environ.get(LOCAL_RANK, "0"))


def is_rank_zero() -> bool:
    """True in the process that reports, writes metrics and removes files (rank 0 or alone)."""
    return rank() == 0
