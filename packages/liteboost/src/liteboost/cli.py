"""``liteboost generate``: text-to-video with Wan, boosted and optionally on several ranks."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Inference boost for diffusers video models (Wan2.1 / Wan2.2).", no_args_is_help=True
)


class VideoFormat(StrEnum):
    GIF = "gif"
    MP4 = "mp4"


@app.callback()
def _root() -> None:
    """Inference boost for diffusers video models (Wan2.1 / Wan2.2)."""


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="What the video shows.")] = "a red kite over hills",
    negative_prompt: Annotated[
        str, typer.Option(help="What classifier-free guidance avoids.")
    ] = "",
    model: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            file_okay=False,
            help="A diffusers Wan folder on disk; default: a tiny random-weight Wan.",
        ),
    ] = None,
    height: Annotated[int, typer.Option(min=16, help="Pixels, a multiple of 16.")] = 64,
    width: Annotated[int, typer.Option(min=16, help="Pixels, a multiple of 16.")] = 64,
    frames: Annotated[int, typer.Option(min=1, help="Frames; Wan wants 4k + 1.")] = 9,
    steps: Annotated[int, typer.Option(min=1, help="Denoising steps.")] = 4,
    guidance: Annotated[float, typer.Option(help="CFG scale (<= 1 disables CFG).")] = 5.0,
    seed: Annotated[int, typer.Option(help="Seed; rank 0's is used on every rank.")] = 0,
    nproc: Annotated[int, typer.Option(min=1, help="Local ranks (ignored under torchrun).")] = 1,
    sparsity: Annotated[
        float, typer.Option(min=0.0, max=0.99, help="Share of self-attention key blocks skipped.")
    ] = 0.0,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per sparse block.")] = 128,
    ulysses: Annotated[
        int | None, typer.Option(help="Ulysses degree: 1 = off; default = all ranks.")
    ] = None,
    vae_parallel: Annotated[
        bool, typer.Option(help="Split VAE decode over time across ranks.")
    ] = True,
    attention_backend: Annotated[
        str | None,
        typer.Option(help="Dense attention: fa3, fa2, npu or sdpa; default: first usable."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("liteboost-out"),
    video_format: Annotated[
        VideoFormat, typer.Option("--format", help="gif or mp4.")
    ] = VideoFormat.GIF,
    max_sequence_length: Annotated[int, typer.Option(min=1, help="Prompt tokens.")] = 64,
    timeout: Annotated[
        float, typer.Option(help="Seconds before a multi-rank run is stopped.")
    ] = 1800.0,
) -> None:
    """Generate a video and write it (GIF/MP4) with a PNG contact sheet of every frame.

    Runs unchanged under torchrun (then --nproc is ignored and each process is one rank).
    """
    from rich.console import Console

    from liteboost.generate import GenerateOptions, generate_rank
    from npu_core.dist import run

    options = GenerateOptions(
        prompt=prompt,
        negative_prompt=negative_prompt,
        model=str(model) if model is not None else None,
        height=height,
        width=width,
        frames=frames,
        steps=steps,
        guidance=guidance,
        seed=seed,
        sparsity=sparsity,
        block_size=block_size,
        ulysses=ulysses,
        vae_parallel=vae_parallel,
        attention_backend=attention_backend,
        out=str(out),
        video_format=video_format.value,
        max_sequence_length=max_sequence_length,
    )
    results = run(generate_rank, nproc, options, timeout=timeout)
    written = next((r for r in results if r is not None), None)
    if written is not None:
        Console().print(
            f"wrote {written['video']} and {written['contact_sheet']} ({written['frames']} frames, "
            f"parallel: {', '.join(written['parallel']) or 'none'})"
        )


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
