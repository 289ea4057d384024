"""``hyperparallel train``: the MoE transformer on a named mesh (FSDP2, HSDP, EP, PP), Muon;
``hyperparallel plan``: what such a run needs at any world size."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from hyperparallel import env
from hyperparallel.train import job
from hyperparallel.train.checkpoint import CheckpointError
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.presets import PRESETS
from npu_core.cli import HelpGroup, config_options, fail, rank_failures, run_app
from npu_core.config import ConfigError

app = typer.Typer(
    cls=HelpGroup,
    help="Parallel training for PyTorch: distributed Muon, FSDP2/HSDP, expert and pipeline "
    "parallelism.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """hyperparallel: distributed Muon, activation memory control, and a training job."""


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
        "hf.source": "--model",
        "hf.tokenizer": "--tokenizer",
        "hf.load_weights": "--load-weights",
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
            help="Replace an earlier run in --out-dir (what it recorded writing: metrics, plot, "
            "checkpoints, logs, traces; nothing else); without it or --resume such a folder "
            "is refused."
        ),
    ] = False,
    allow_config_change: Annotated[
        bool,
        typer.Option(
            help="With --resume: accept model or data settings that differ from the run's "
            "(refused otherwise, naming the fields)."
        ),
    ] = False,
) -> None:
    """Train the built-in MoE transformer, or a transformers model with --model, on N local
    CPU ranks (or under torchrun, unchanged).

    --model PATH: a local transformers model folder (config.json, optionally weights and
    tokenizer files) or a config.json file, e.g. `--model ./Qwen3-0.6B --mesh fsdp`. Dense,
    MoE and MLA+MoE families (Llama, Qwen3, Qwen3-MoE, Qwen3-Next, GLM-4.5, gpt-oss, MiniMax-M2,
    DeepSeek-V3, Gemma 3, Phi-3) train with FSDP2/HSDP per decoder block, Muon for hidden
    matrices and expert stacks, AdamW for the rest; MoE families also with ep (experts
    sharded, tokens by all-to-all, e.g. --mesh ep=2,dp_shard=2); pp (e.g. --mesh pp=2,ep=2) for
    the architectures their family cuts into stages. Weights load when the folder has them
    (else random from --seed; --set hf.overrides={...} changes the shape); the folder's
    tokenizer is used when it has one, else bytes.

    Prints the saved-activation bytes of a step by placement (device / host / recomputed).
    Writes OUT_DIR/metrics.json, OUT_DIR/loss.png and DCP checkpoints in OUT_DIR/checkpoints;
    a failed rank's traceback goes to OUT_DIR/logs.
    """
    cfg = config
    try:
        job.prepare(
            cfg,
            resume=resume,
            overwrite=overwrite,
            allow_config_change=allow_config_change,
            warn=_warn,
        )
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        fail(str(exc))
    # A rank's failure (a signal, out of memory, a full disk, a stopped peer, an exception) is
    # one line naming the rank and the cause; its traceback is kept in OUT_DIR/logs.
    with rank_failures(Path(cfg.out_dir) / "logs"):
        try:
            results = job.start(cfg, resume=resume)
        except CheckpointError as exc:  # a fact about the user's files: exit 2, like a refusal
            fail(str(exc))
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


PLAN_FLAGS = {
    "parallel.mesh": "--mesh",
    "parallel.pp_schedule": "--pp-schedule",
    "parallel.microbatches": "--microbatches",
    "activation.policy": "--activation",
    "activation.swap_inputs": "--swap-inputs",
    "hf.source": "--model",
}
"""The train options a plan reads under the same names (the rest stay reachable by --set)."""


@app.command()
@config_options(TrainConfig, flags=PLAN_FLAGS, base=_preset)
def plan(
    config: TrainConfig,
    world: Annotated[int, typer.Option(help="Ranks of the run (2 to 16,384 and beyond).")],
    preset: Annotated[
        str, typer.Option(help=f"Base configuration: {', '.join(PRESETS)}.")
    ] = "default",
    device: Annotated[
        str,
        typer.Option(
            help="Device profile of the estimate: h100, h200, ascend-910b, cpu "
            "(measured here) or a .toml file."
        ),
    ] = "h100",
    search: Annotated[
        bool, typer.Option(help="List the meshes of --world that fit, fastest first.")
    ] = False,
    device_memory: Annotated[
        str | None,
        typer.Option(help="Memory per rank for --search, e.g. 80GiB (default: the device's)."),
    ] = None,
    efficiency: Annotated[
        float | None,
        typer.Option(
            help="Fraction of peak FLOP/s the compute reaches (default 0.5, 1.0 for cpu)."
        ),
    ] = None,
) -> None:
    """Predict what a `hyperparallel train` run needs at --world ranks, from the job's own code:
    per-rank parameter, gradient, optimizer and saved-activation bytes and the peak; bytes per
    collective and mesh dimension; Newton-Schulz work per rank and its balance; a step-time
    estimate. The model is built on the meta device (no memory): --model PATH for a
    transformers config at its real size, else the built-in MoE. A mesh the job refuses is
    refused here in the same words, e.g. `--world 1024 --mesh pp=8,ep=8,dp_shard=16`.
    """
    from hyperparallel.plan.command import run_plan

    try:
        run_plan(
            config,
            world,
            device=device,
            search=search,
            device_memory=device_memory,
            efficiency=efficiency,
            console=console,
        )
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def _warn(message: str) -> None:
    typer.echo(f"warning: {message}", err=True)


def main() -> None:
    """Console-script entry point (a command line click refuses: one line, exit 2)."""
    run_app(app)


if __name__ == "__main__":
    main()
