"""Checks that a configuration fits a mesh layout, before any rank starts (pure Python)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyperparallel.parallel.mesh import ParallelDims
from hyperparallel.parallel.pipeline import split_layers, stages_per_rank

if TYPE_CHECKING:
    from hyperparallel.train.config import TrainConfig


def local_batch_size(
    batch_size: int, global_batch_size: int | None, dims: ParallelDims, microbatches: int
) -> int:
    """Samples per data-parallel rank per step; ``global_batch_size``, when set, is split over
    the ``dp_replicate x ep x dp_shard`` data-parallel ranks.

    Raises:
        ValueError: a global batch not divisible by the data-parallel ranks, or (under PP) a
            local batch not divisible by ``parallel.microbatches``; the message names both.
    """
    local = batch_size
    if global_batch_size is not None:
        if global_batch_size % dims.dp_size:
            raise ValueError(
                f"data.global_batch_size={global_batch_size} is not divisible by the "
                f"{dims.dp_size} data-parallel ranks of --mesh {dims.spec()}"
            )
        local = global_batch_size // dims.dp_size
    if dims.pp > 1 and local % microbatches:
        raise ValueError(
            f"parallel.microbatches={microbatches} must divide the {local} samples per "
            f"data-parallel rank under --mesh {dims.spec()}"
        )
    return local


def check_layout(cfg: TrainConfig, dims: ParallelDims) -> int:
    """Everything about ``cfg`` (a ``TrainConfig``) that depends on the mesh; returns the local
    batch size.

    Raises:
        ValueError: naming the setting and the mesh dimension it conflicts with.
    """
    par = cfg.parallel
    local = local_batch_size(
        cfg.data.batch_size, cfg.data.global_batch_size, dims, par.microbatches
    )
    # a transformers model (hf.source) checks its own expert count (train.hf_model)
    if dims.ep > 1 and cfg.hf.source is None and cfg.model.n_experts % (dims.ep * dims.dp_shard):
        raise ValueError(
            f"model.n_experts={cfg.model.n_experts} must be divisible by ep x dp_shard = "
            f"{dims.ep} x {dims.dp_shard} (each rank stores whole experts)"
        )
    if par.pp_early_recompute:
        if dims.pp == 1 or par.pp_schedule not in ("1f1b", "dualpipev"):
            raise ValueError(
                "parallel.pp_early_recompute needs a pp dimension and --pp-schedule 1f1b or "
                f"dualpipev (got --mesh {dims.spec()}, --pp-schedule {par.pp_schedule})"
            )
        if cfg.activation.policy == "none" and not cfg.activation.per_block:
            raise ValueError(
                "parallel.pp_early_recompute has nothing to replay with --activation none; "
                "choose a policy that recomputes (recompute, selective)"
            )
    if dims.pp > 1:
        n_stages = dims.pp * stages_per_rank(par.pp_schedule, par.virtual_stages)
        split_layers(cfg.model.n_layers, n_stages)
        if par.microbatches < n_stages and par.pp_schedule != "1f1b":
            raise ValueError(
                f"parallel.microbatches={par.microbatches} is below the {n_stages} stages of "
                f"--pp-schedule {par.pp_schedule} on pp={dims.pp}; use at least {n_stages}"
            )
    return local
