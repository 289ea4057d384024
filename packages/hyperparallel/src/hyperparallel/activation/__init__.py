"""Activation memory control in eager mode: per-op save / recompute / swap inside checkpointed
regions, exclusion from recompute, asynchronous swap of region inputs with prefetch, recompute as
a schedulable task (also inside pipeline schedules), and an exact saved-bytes report.

The pipeline schedules (``EarlyRecompute1F1B``, ``EarlyRecomputeDualPipeV``, ``PairedRecompute``)
are imported on first use: ``torch.distributed.pipelining`` brings in torch's compiler stack
(about 3 s), which nothing but a pipelined run needs.
"""

from typing import Any

from hyperparallel.activation.checkpoint import checkpoint, checkpoint_wrapper, swap_wrapper
from hyperparallel.activation.exclude import checkpoint_exclude_wrapper
from hyperparallel.activation.observers import ObservedRegion, RegionObserver
from hyperparallel.activation.policy import (
    MATMUL_OPS,
    POLICY_NAMES,
    CheckpointPolicy,
    PolicyContext,
    PolicyFn,
    compose,
    is_collective,
    resolve,
    save_matmuls_and_collectives,
    swap_saved_above,
    uniform,
)
from hyperparallel.activation.report import (
    ActivationReport,
    ActivationTracker,
    track_saved_activations,
)
from hyperparallel.activation.schedule import RecomputeHandle, RecomputeSession
from hyperparallel.activation.swap import SwapSchedule

__all__ = [
    "MATMUL_OPS",
    "POLICY_NAMES",
    "ActivationReport",
    "ActivationTracker",
    "CheckpointPolicy",
    "EarlyRecompute1F1B",
    "EarlyRecomputeDualPipeV",
    "ObservedRegion",
    "PairedRecompute",
    "PolicyContext",
    "PolicyFn",
    "RecomputeHandle",
    "RecomputeSession",
    "RegionObserver",
    "SwapSchedule",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_wrapper",
    "compose",
    "is_collective",
    "resolve",
    "save_matmuls_and_collectives",
    "swap_saved_above",
    "swap_wrapper",
    "track_saved_activations",
    "uniform",
]

_PIPELINE_NAMES = ("EarlyRecompute1F1B", "EarlyRecomputeDualPipeV", "PairedRecompute")


def __getattr__(name: str) -> Any:
    """The pipeline schedules, imported when first asked for (see the module docstring)."""
    if name in _PIPELINE_NAMES:
        from hyperparallel.activation import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
