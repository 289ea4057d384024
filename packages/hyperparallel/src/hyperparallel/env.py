"""Environment variables read by hyperparallel, in one place (read when asked, never at import).

Only the process-placement variables that torchrun and the npu-core launcher set are read; every
setting of a run is a configuration field instead (``--set``), so a run is reproducible from its
``metrics.json``. The global rank is npu-core's (:func:`npu_core.env.launch_rank`).
"""

from __future__ import annotations

import os

from npu_core.env import launch_rank

LOCAL_RANK = "LOCAL_RANK"
"""Rank on this node; chooses the accelerator index."""


def local_rank() -> int:
    """This process's rank on its node, 0 outside a distributed launch."""
    return int(os.environ.get(LOCAL_RANK, "0"))


def is_rank_zero() -> bool:
    """True in the process that reports, writes metrics and removes files (rank 0 or alone)."""
    return launch_rank() == 0
