"""``hyperparallel train``: the MoE transformer on a named mesh (FSDP2, HSDP, EP, PP), Muon."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from hyperparallel import env
from hyperparallel.data.stdlib_bytes import ByteBatches, read_corpus
from hyperparallel.parallel.dims import parse_mesh
from hyperparallel.parallel.layout import check_layout
from hyperparallel.train.checkpoint import CheckpointError, has_checkpoints
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.outdir import prepare_out_dir
from hyperparallel.train.presets import PRESETS
from npu_core.cli import config_options
from npu_core.config import ConfigError
from npu_core.dist import is_torchrun, run

app = typer.Typer(
    help="Parallel training for PyTorch: distributed Muon, FSDP2/HSDP, expert and pipeline "
    "parallelism.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """hyperparallel: distributed Muon, activation memory control, and a training job."""


def _rank_main(cfg: TrainConfig, resume: bool):
    """Entry of every rank; rank 0 draws the progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hyperparallel.train.trainer import train_rank

    if not env.is_rank_zero():
        return train_rank(cfg, resume)
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("train", total=cfg.steps, status="starting ranks")

        def on_step(record: dict[str, float]) -> None:
            status = (
                f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
                f"backward {record['backward_ms']:.0f} ms  optim {record['optim_ms']:.0f} ms"
            )
            if "val_loss" in record:
                status += f"  val {record['val_loss']:.3f}"
            progress.update(task, completed=record["step"], status=status)

        return train_rank(cfg, resume, on_step)


def _preset(args: dict) -> TrainConfig:
    name = args["preset"]
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()


@app.command()
@config_options(
    TrainConfig,
    flags={
        "parallel.nproc": "--nproc",
        "parallel.mesh": "--mesh",
        "parallel.pp_schedule": "--pp-schedule",
        "parallel.microbatches": "--microbatches",
        "parallel.timeout_s": "--timeout",
        "data.path": "--data",
        "activation.policy": "--activation",
        "activation.swap_inputs": "--swap-inputs",
    },
    base=_preset,
)
def train(
    config: TrainConfig,
    preset: Annotated[
        str, typer.Option(help=f"Base configuration: {', '.join(PRESETS)}.")
    ] = "default",
    resume: Annotated[
        bool, typer.Option(help="Continue from the last complete checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Replace an earlier run in --out-dir (its metrics, plot and checkpoints); "
            "without it or --resume such a folder is refused."
        ),
    ] = False,
) -> None:
    """Train the MoE transformer on N local CPU ranks (or under torchrun, unchanged).

    Prints the saved-activation bytes of a step by placement (device / host / recomputed).
    Writes OUT_DIR/metrics.json, OUT_DIR/loss.png and DCP checkpoints in OUT_DIR/checkpoints.
    """
    cfg = config
    try:
        if not is_torchrun():  # under torchrun the world size is known only to the ranks
            check_layout(cfg, parse_mesh(cfg.parallel.mesh, cfg.parallel.nproc))
        _check_data(cfg)
        out = Path(cfg.out_dir)
        if resume and not overwrite and not has_checkpoints(out / "checkpoints"):
            raise ValueError(
                f"--resume: no checkpoint under {out / 'checkpoints'}; run without --resume "
                "to start a new run"
            )
        prepare_out_dir(out, resume=resume, overwrite=overwrite, remove=env.is_rank_zero())
    except (ValueError, FileNotFoundError) as exc:
        _refuse(str(exc))
    try:
        results = run(_rank_main, cfg.parallel.nproc, cfg, resume, timeout=24 * 3600, backend=None)
    except CheckpointError as exc:  # a fact about the user's files: one line, not a traceback
        _refuse(str(exc))
    if not env.is_rank_zero():  # under torchrun, rank 0 alone reports
        return
    first = results[0]
    if first.train_losses:
        console.print(
            f"steps {first.first_step}->{first.last_step}: loss {first.train_losses[0]:.3f} -> "
            f"{first.train_losses[-1]:.3f}"
            + (f", val {first.val_losses[-1]:.3f}" if first.val_losses else "")
        )
    if first.activation:
        a = first.activation
        console.print(
            f"saved activations per step (rank 0, {a['regions']} checkpointed blocks): "
            f"device {a['device_bytes'] / 2**20:.2f} MiB, host {a['host_bytes'] / 2**20:.2f} "
            f"MiB, recomputed {a['recomputed_bytes'] / 2**20:.2f} MiB"
        )
    console.print(
        f"wrote {cfg.out_dir}/metrics.json, {cfg.out_dir}/loss.png, {cfg.out_dir}/checkpoints"
    )


def _refuse(message: str) -> None:
    """One line on stderr and exit 2: bad input is the user's to fix, a traceback would hide it."""
    if env.is_rank_zero():
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_data(cfg: TrainConfig) -> None:
    """Read the corpus once before ranks start: a missing, empty, binary or too-small source is
    refused here instead of in every rank after start-up (binary files inside a folder are
    skipped with one warning line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        ByteBatches(
            read_corpus(cfg.data.path, cfg.data.max_bytes), cfg.data.seq_len, cfg.data.val_fraction
        )
    for warning in caught:
        if env.is_rank_zero():
            typer.echo(f"warning: {warning.message}", err=True)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
