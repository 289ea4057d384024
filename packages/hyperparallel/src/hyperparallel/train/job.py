"""The training job as a Python call: checks before any rank starts, then the ranks.

``hyperparallel train`` is this plus printing; other tools (``modelzoo train``) call
:func:`run_job` directly instead of spawning the CLI. Everything a user can get wrong (mesh,
data, ``--model`` and its weight files, a model too large for the machine, output folder,
resume) is refused by :func:`check` and :func:`prepare` in one ``ValueError`` /
``FileNotFoundError`` line before anything is written and before any rank or process group
exists.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path

from hyperparallel import env
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.train.checkpoint import has_checkpoints, latest
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.config_change import check_resume_config
from hyperparallel.train.memory import check_host_memory
from hyperparallel.train.outdir import prepare_out_dir, run_artefacts
from hyperparallel.train.registry import model_spec
from hyperparallel.train.trainer import TrainResult
from npu_core.dist import is_torchrun, run

Warn = Callable[[str], None]


def check(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> list[str]:
    """Everything that can be checked without ranks; returns warnings (skipped binary files, a
    warm-up longer than the run, a resume whose settings cannot be compared).

    Args:
        allow_config_change: with ``resume``, accept model or data settings that differ from
            the run's (refused otherwise).

    Raises:
        ValueError, FileNotFoundError: one line naming the setting and what is allowed.
        hyperparallel.train.checkpoint.CheckpointError: ``resume`` and no checkpoint loads.
    """
    spec = model_spec(cfg)
    spec.check_weights()
    torchrun = is_torchrun()
    if not torchrun:  # under torchrun the world size is known only to the ranks
        spec.check_layout(parse_mesh(cfg.parallel.mesh, cfg.parallel.nproc))
    counted = spec.parameter_count()
    if counted is not None:  # under torchrun this process is the one rank it can see
        parameters, model = counted
        ranks = 1 if torchrun else cfg.parallel.nproc
        check_host_memory(parameters, ranks, model, dtype=cfg.dtype)
    if allow_config_change and not resume:
        raise ValueError("--allow-config-change applies only with --resume")
    # The corpus is read (and tokenized) once here: a missing, empty, binary or too-small source
    # is refused before ranks start instead of in every rank after start-up.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        spec.batches()
    messages = [str(w.message) for w in caught]
    if resume and not overwrite:
        messages += _check_resume(cfg, allow_config_change)
    warmup = cfg.optim.warmup_steps
    if warmup > cfg.steps:
        messages.append(
            f"optim.warmup_steps={warmup} is above steps={cfg.steps}: the learning rates rise "
            f"to {cfg.steps / warmup:.0%} of their settings at the last step and never decay; "
            "lower optim.warmup_steps"
        )
    return messages


def _check_resume(cfg: TrainConfig, allow_config_change: bool) -> list[str]:
    """A checkpoint that loads, and the run's model and data settings unchanged; the warnings
    (damaged newer checkpoints skipped, accepted changes).

    The checkpoints are verified here and again by rank 0 when it loads one (reading them
    twice on resume), so that a folder with none that loads is refused before anything is
    written, and the skipped ones are named once, by the CLI.

    Raises:
        ValueError: no checkpoint at all, or changed settings without ``allow_config_change``.
        hyperparallel.train.checkpoint.CheckpointError: none of the checkpoints loads.
    """
    root = Path(cfg.out_dir) / "checkpoints"
    if not has_checkpoints(root):
        raise ValueError(
            f"--resume: no checkpoint under {root}; run without --resume to start a new run"
        )
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always", RuntimeWarning)
        latest(root)
    messages = [str(w.message) for w in skipped]
    changed = check_resume_config(cfg, allow_change=allow_config_change)
    return [*messages, changed] if changed else messages


def run_job(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    progress: bool = True,
    warn: Warn | None = None,
) -> list[TrainResult]:
    """Check ``cfg``, prepare ``out_dir``, train on ``parallel.nproc`` local ranks (or this one
    under torchrun) and return every rank's result.

    Args:
        resume: continue from the newest intact checkpoint in ``out_dir``.
        overwrite: replace an earlier run in ``out_dir`` (refused without it or ``resume``).
        allow_config_change: with ``resume``, accept changed model or data settings.
        progress: rank 0 draws a progress bar on stderr.
        warn: receives each warning of :func:`check` (rank 0 only).

    Raises:
        ValueError, FileNotFoundError: refused input, before any rank starts.
        hyperparallel.train.checkpoint.CheckpointError: no usable checkpoint to resume from
            (before ranks start), or the one found does not fit the model (in the ranks).
    """
    prepare(
        cfg, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change, warn=warn
    )
    return start(cfg, resume=resume, progress=progress)


def prepare(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    warn: Warn | None = None,
) -> None:
    """:func:`check`, then make ``out_dir`` ready (refusing to mix with an earlier run or with
    files the run did not create); nothing is written until every check has passed."""
    messages = check(
        cfg, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change
    )
    for message in messages:
        if warn is not None and env.is_rank_zero():
            warn(message)
    artefacts = run_artefacts(cfg)
    prepare_out_dir(
        Path(cfg.out_dir), artefacts, resume=resume, overwrite=overwrite, owner=env.is_rank_zero()
    )


def start(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> list[TrainResult]:
    """Train on the ranks (after :func:`prepare`); every rank's result, rank 0 first.

    The launch itself has no time limit (a long run takes as long as it takes): a rank that
    dies is noticed by the launcher at once, and one that stops or hangs by its peers'
    collective timeout (``parallel.timeout_s``), which ends the run naming it.
    """
    results: list[TrainResult] = run(
        rank_main, cfg.parallel.nproc, cfg, resume, progress, timeout=math.inf, backend=None
    )
    return results


def rank_main(cfg: TrainConfig, resume: bool, progress: bool = True) -> TrainResult:
    """Entry of every rank; with ``progress`` rank 0 draws the progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hyperparallel.train.trainer import train_rank

    if not progress or not env.is_rank_zero():
        return train_rank(cfg, resume)
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("train", total=cfg.steps, status="starting ranks")

        def on_step(record: dict[str, float]) -> None:
            status = (
                f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
                f"backward {record['backward_ms']:.0f} ms  optim {record['optim_ms']:.0f} ms"
            )
            if "val_loss" in record:
                status += f"  val {record['val_loss']:.3f}"
            bar.update(task, completed=record["step"], status=status)

        return train_rank(cfg, resume, on_step)
