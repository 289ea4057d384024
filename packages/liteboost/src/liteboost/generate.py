"""One rank of ``liteboost generate``: build the pipeline, boost, parallelise, sample, write."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class GenerateOptions:
    """Everything one rank needs; picklable so the launcher can ship it to every rank."""

    prompt: str
    negative_prompt: str
    model: str | None
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    seed: int
    sparsity: float
    block_size: int
    ulysses: int | None
    vae_parallel: bool
    attention_backend: str | None
    out: str
    video_format: str
    max_sequence_length: int


def _load_pipeline(model: str | None):
    if model is None:
        from liteboost.tiny import build_tiny_pipeline

        return build_tiny_pipeline()
    from diffusers import WanPipeline

    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory (a diffusers Wan folder)")
    return WanPipeline.from_pretrained(path, local_files_only=True)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def generate_rank(options: GenerateOptions) -> dict | None:
    """Run the pipeline on this rank; rank 0 writes the outputs and returns their paths."""
    from rich.progress import Progress

    from liteboost.boost import BoostManager
    from liteboost.parallel.manager import ParallelManager
    from liteboost.video_io import to_uint8, write_contact_sheet, write_video

    pipe = _load_pipeline(options.model)
    pipe.set_progress_bar_config(disable=True)
    BoostManager(
        pipe,
        sparsity=options.sparsity,
        attention_backend=options.attention_backend,
        block_size=options.block_size,
    )
    parallel = ParallelManager(
        pipe, ulysses_degree=options.ulysses, vae_parallel=options.vae_parallel
    )
    seed = parallel.sync_seed(options.seed)
    lead = _rank() == 0
    with Progress(disable=not lead, transient=False) as progress:
        task = progress.add_task("denoising", total=options.steps)

        def on_step(pipeline, step, timestep, kwargs):
            progress.advance(task)
            return kwargs

        frames = pipe(
            prompt=options.prompt,
            negative_prompt=options.negative_prompt,
            height=options.height,
            width=options.width,
            num_frames=options.frames,
            num_inference_steps=options.steps,
            guidance_scale=options.guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            max_sequence_length=options.max_sequence_length,
            callback_on_step_end=on_step,
        ).frames[0]
    if not lead:
        return None
    frames = to_uint8(frames)
    out = Path(options.out)
    video = write_video(frames, out / f"video.{options.video_format}")
    sheet = write_contact_sheet(frames, out / "contact_sheet.png")
    return {
        "video": os.fspath(video),
        "contact_sheet": os.fspath(sheet),
        "frames": int(frames.shape[0]),
        "parallel": parallel.parallelized,
        "options": asdict(options),
    }
