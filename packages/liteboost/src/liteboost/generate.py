"""One rank of ``liteboost generate``: build the pipeline, boost, parallelise, sample, write."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from liteboost.attention.backends import parse_backend
from npu_core.config import StrictConfig

if TYPE_CHECKING:
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline


class GenerateOptions(StrictConfig):
    """Everything one rank needs; each field is a ``liteboost generate`` option (its help).

    Picklable, so the launcher ships it to every rank. Ranges are checked here; what needs the
    model's configs or the file system is checked by :mod:`liteboost.preflight`.
    """

    prompt: str = Field("a red kite over hills", description="What the video shows.")
    negative_prompt: str = Field("", description="What classifier-free guidance avoids.")
    model: str | None = Field(
        None, description="A diffusers Wan folder on disk; default: a tiny random-weight Wan."
    )
    height: int = Field(64, ge=16, description="Pixels, a multiple of 16 (of the patch grid).")
    width: int = Field(64, ge=16, description="Pixels, a multiple of 16 (of the patch grid).")
    frames: int = Field(9, ge=1, description="Frames; Wan wants 4k + 1.")
    steps: int = Field(4, ge=1, description="Denoising steps.")
    guidance: float = Field(5.0, allow_inf_nan=False, description="CFG scale (<= 1 disables CFG).")
    seed: int = Field(0, description="Seed; rank 0's is used on every rank.")
    sparsity: float = Field(
        0.0, ge=0.0, lt=1.0, description="Share of self-attention key blocks skipped."
    )
    block_size: int = Field(128, ge=1, description="Tokens per sparse block.")
    ulysses: int | None = Field(
        None,
        ge=1,
        description="Ulysses degree: 1 = off; default = the ranks left by --cfg-parallel x --ring.",
    )
    cfg_parallel: int = Field(
        1,
        ge=1,
        le=2,
        description="2 runs the conditional and unconditional branches on different ranks.",
    )
    ring: int = Field(
        1, ge=1, description="Ring-attention degree (K/V passed between ranks); 1 = off."
    )
    vae_parallel: bool = Field(True, description="Split the VAE decode across ranks.")
    vae_mode: Literal["temporal", "spatial"] | None = Field(
        None,
        description="How the VAE decode is split: temporal (spans of frames, bit-identical to "
        "stock), spatial (row slabs with halo exchange, equal to float rounding); default: "
        "whichever does less work for the shape.",
    )
    cache: Literal["first_block", "pab", "taylorseer", "faster"] | None = Field(
        None,
        description="Step caching through diffusers' hooks: first_block (skip the remaining "
        "blocks when the first block's output barely changed), pab (pyramid attention "
        "broadcast), taylorseer (extrapolated features), faster (FasterCache: self-attention "
        "reused per CFG branch); default: none.",
    )
    cache_threshold: float | None = Field(
        None,
        gt=0,
        description="first_block: relative change below which a step reuses the cache "
        "(diffusers' default 0.05; random-weight models need ~0.2 to skip anything).",
    )
    attention_backend: str | None = Field(
        None, description="Dense attention: fa3, fa2, npu or sdpa; default: first usable."
    )
    out: str = Field("liteboost-out", description="Output folder.")
    video_format: Literal["gif", "mp4"] = Field("gif", description="gif or mp4.")
    max_sequence_length: int = Field(64, ge=1, description="Prompt tokens.")

    @model_validator(mode="after")
    def _threshold_needs_first_block(self) -> GenerateOptions:
        if self.cache_threshold is not None and self.cache != "first_block":
            raise ValueError(
                f"cache_threshold applies to cache='first_block', not cache={self.cache!r}"
            )
        return self

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        return None if value is None else parse_backend(value).value


def _load_pipeline(model: str | None) -> WanPipeline:
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
        cache=options.cache,
        cache_threshold=options.cache_threshold,
    )
    parallel = ParallelManager(
        pipe,
        ulysses_degree=options.ulysses,
        vae_parallel=options.vae_parallel,
        cfg_degree=options.cfg_parallel,
        ring_degree=options.ring,
        vae_mode=options.vae_mode,
    )
    seed = parallel.sync_seed(options.seed)
    lead = _rank() == 0
    with Progress(disable=not lead, transient=False) as progress:
        task = progress.add_task("denoising", total=options.steps)

        def on_step(
            pipeline: Any, step: int, timestep: Any, kwargs: dict[str, Any]
        ) -> dict[str, Any]:
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
        "options": options.model_dump(),
    }
