"""The training job as a Python call: checks before any rank starts, then the ranks.

``hyperparallel train`` is this plus printing; other tools (``modelzoo train``) call
:func:`run_job` directly instead of spawning the CLI. Everything a user can get wrong (mesh,
data, ``--model``, output folder, resume) is refused by :func:`check` in one ``ValueError`` /
``FileNotFoundError`` line before any rank or process group exists.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from hyperparallel import env
from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.train.checkpoint import has_checkpoints
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.outdir import prepare_out_dir
from hyperparallel.train.registry import model_spec
from hyperparallel.train.trainer import TrainResult
from npu_core.dist import is_torchrun, run

Warn = Callable[[str], None]


def check(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> list[str]:
    """Everything that can be checked without ranks; returns warnings (skipped binary files).

    Raises:
        ValueError, FileNotFoundError: one line naming the setting and what is allowed.
    """
    spec = model_spec(cfg)
    if not is_torchrun():  # under torchrun the world size is known only to the ranks
        spec.check_layout(parse_mesh(cfg.parallel.mesh, cfg.parallel.nproc))
    # The corpus is read (and tokenized) once here: a missing, empty, binary or too-small source
    # is refused before ranks start instead of in every rank after start-up.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        spec.batches()
    out = Path(cfg.out_dir)
    if resume and not overwrite and not has_checkpoints(out / "checkpoints"):
        raise ValueError(
            f"--resume: no checkpoint under {out / 'checkpoints'}; run without --resume "
            "to start a new run"
        )
    return [str(w.message) for w in caught]


def run_job(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    warn: Warn | None = None,
) -> list[TrainResult]:
    """Check ``cfg``, prepare ``out_dir``, train on ``parallel.nproc`` local ranks (or this one
    under torchrun) and return every rank's result.

    Args:
        resume: continue from the newest intact checkpoint in ``out_dir``.
        overwrite: replace an earlier run in ``out_dir`` (refused without it or ``resume``).
        progress: rank 0 draws a progress bar on stderr.
        warn: receives each warning of :func:`check` (rank 0 only).

    Raises:
        ValueError, FileNotFoundError: refused input, before any rank starts.
        hyperparallel.train.checkpoint.CheckpointError: no usable checkpoint to resume from.
    """
    prepare(cfg, resume=resume, overwrite=overwrite, warn=warn)
    return start(cfg, resume=resume, progress=progress)


def prepare(
    cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, warn: Warn | None = None
) -> None:
    """:func:`check`, then make ``out_dir`` ready (refusing to mix with an earlier run)."""
    for message in check(cfg, resume=resume, overwrite=overwrite):
        if warn is not None and env.is_rank_zero():
            warn(message)
    prepare_out_dir(
        Path(cfg.out_dir), resume=resume, overwrite=overwrite, remove=env.is_rank_zero()
    )


def start(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> list[TrainResult]:
    """Train on the ranks (after :func:`prepare`); every rank's result, rank 0 first."""
    results: list[TrainResult] = run(
        rank_main, cfg.parallel.nproc, cfg, resume, progress, timeout=24 * 3600, backend=None
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
