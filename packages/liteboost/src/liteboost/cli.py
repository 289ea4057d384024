"""``liteboost generate``: text-to-video with Wan, boosted and optionally on several ranks;
``liteboost build-cpu-kernel``: build the C++ CPU extension ahead of its first use.

The generate options come from :class:`liteboost.generate.GenerateOptions` (``npu_core.cli``), so
``--config FILE.toml`` and ``--set field=value`` reach every field. Every input is checked
before a model is built (:mod:`liteboost.preflight`): a bad one is one line on stderr, exit 2.
A rank that fails is one line too (the rank and the cause), exit 1, with its traceback kept in
``<out>/logs/rank<N>.log``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from liteboost.generate import GenerateOptions
from npu_core.cli import HelpGroup, config_options, fail, rank_failures, run_app

app = typer.Typer(
    cls=HelpGroup,
    help="Inference boost for diffusers video models (Wan2.1 / Wan2.2).",
    no_args_is_help=True,
)


@app.callback()
def _root() -> None:
    """Inference boost for diffusers video models (Wan2.1 / Wan2.2)."""


def preflight(config: GenerateOptions, *, nproc: int, timeout: float, overwrite: bool) -> None:
    """Refuse, before any work, every input that cannot work (see :mod:`liteboost.preflight`).

    Raises:
        liteboost.preflight.PreflightError: one line naming the option, value and rule.
    """
    from liteboost import preflight as checks
    from npu_core.dist import is_torchrun

    checks.check_numbers(nproc=nproc, timeout=timeout)
    checks.check_mesh(
        nproc=None if is_torchrun() else nproc,
        cfg=config.cfg_parallel,
        ulysses=config.ulysses,
        ring=config.ring,
    )
    facts = checks.model_facts(config.model)
    checks.check_size(config.height, config.width, config.frames, facts)
    checks.check_attention_backend(config.attention_backend, facts)
    checks.check_comm_backend_here()
    checks.check_out(Path(config.out), config.video_format, overwrite)


@app.command()
@config_options(GenerateOptions, flags={"video_format": "--format"})
def generate(
    config: GenerateOptions,
    nproc: Annotated[int, typer.Option(help="Local ranks (ignored under torchrun).")] = 1,
    timeout: Annotated[
        float, typer.Option(help="Seconds before a multi-rank run is stopped.")
    ] = 1800.0,
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace the video and contact sheet of an earlier run in --out."),
    ] = False,
) -> None:
    """Generate a video and write it (GIF/MP4) with a PNG contact sheet of every frame.

    Runs unchanged under torchrun (then --nproc is ignored and each process is one rank).
    """
    from rich.console import Console

    from liteboost.generate import generate_rank
    from liteboost.preflight import PreflightError
    from npu_core.dist import run

    try:
        preflight(config, nproc=nproc, timeout=timeout, overwrite=overwrite)
    except PreflightError as exc:
        fail(str(exc))
    with rank_failures(Path(config.out) / "logs"):
        results = run(generate_rank, nproc, config, timeout=timeout)
    written = next((r for r in results if r is not None), None)
    if written is not None:
        Console().print(
            f"wrote {written['video']} and {written['contact_sheet']} ({written['frames']} frames, "
            f"parallel: {', '.join(written['parallel']) or 'none'})"
        )


@app.command("build-cpu-kernel")
def build_cpu_kernel() -> None:
    """Build liteboost's C++ CPU extension now (or load it when already built) and say where.

    It holds the fused block-sparse attention kernel (the CPU default) and the eager RoPE loop.
    Otherwise the first sparse or RoPE call on CPU builds it (about a minute, once per machine,
    vector ISA and torch version). The cache lies under torch's extension root, which
    TORCH_EXTENSIONS_DIR moves. Exit 1 when it cannot be built: liteboost then runs its torch
    fallbacks (block gather, the torch RoPE form).
    """
    from liteboost.ops.cpu_extension import build_cpu_extension

    typer.echo("building or loading liteboost's CPU kernel extension (a first build takes ~1 min)")
    try:
        extension = build_cpu_extension()
    except Exception as exc:  # the toolchain's own message is the useful part
        fail(f"the CPU kernel extension cannot be built here: {exc}", code=1)
    done = "built" if extension.built else "already built; loaded"
    typer.echo(f"{done} {extension.name} ({extension.tag}) in {extension.seconds:.2f} s")
    typer.echo(f"cached at {extension.library}")


def main() -> None:
    """Console-script entry point (a command line click refuses: one line, exit 2)."""
    run_app(app)


if __name__ == "__main__":
    main()
