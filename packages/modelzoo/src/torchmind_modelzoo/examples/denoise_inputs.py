"""Per-denoiser conditioning: what each diffusers transformer's forward needs besides the latent.

Each builder returns (inputs, spec): ``inputs`` holds the keyword tensors of one denoiser call
(``hidden_states`` is the noisy latent in the layout the model consumes) and ``spec`` says how
timesteps are scaled and how condition channels are attached. Add a builder to support a new
denoiser class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from torchmind_modelzoo.schema import ExampleConfig


@dataclasses.dataclass(frozen=True)
class DenoiseSpec:
    """How the sampling loop drives one denoiser.

    Attributes:
        timestep_scale: the model's timestep = scheduler sigma * 1000 * scale (Flux: 1/1000).
        cond_dim: dimension where fixed condition channels are appended to the latent (I2V).
        cond: condition tensor (image latent + mask), or None.
    """

    timestep_scale: float = 1.0
    cond_dim: int = 1
    cond: torch.Tensor | None = None


Builder = Callable[[Any, ExampleConfig, torch.dtype], tuple[dict[str, torch.Tensor], DenoiseSpec]]
_BUILDERS: dict[str, Builder] = {}


def register_builder(architecture: str) -> Callable[[Builder], Builder]:
    """Decorator: register the input builder of a diffusers denoiser class."""

    def wrap(fn: Builder) -> Builder:
        _BUILDERS[architecture] = fn
        return fn

    return wrap


def builder_for(architecture: str) -> Builder:
    """The input builder of ``architecture``; KeyError names the supported classes."""
    if architecture not in _BUILDERS:
        raise KeyError(f"no denoise inputs for {architecture!r}; supported: {sorted(_BUILDERS)}")
    return _BUILDERS[architecture]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@register_builder("FluxTransformer2DModel")
def _flux(config: Any, ex: ExampleConfig, dtype: torch.dtype) -> tuple[dict, DenoiseSpec]:
    # Flux consumes 2x2-packed latents as a token sequence [B, H/2 * W/2, 4C] with 3-axis ids.
    _, height, width = ex.latent_shape
    h, w = height // 2, width // 2
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    inputs = {
        "hidden_states": _randn(1, h * w, config.in_channels, dtype=dtype, seed=1),
        "encoder_hidden_states": _randn(
            1, ex.text_len, config.joint_attention_dim, dtype=dtype, seed=2
        ),
        "pooled_projections": _randn(1, config.pooled_projection_dim, dtype=dtype, seed=3),
        "img_ids": img_ids.reshape(h * w, 3).to(dtype),
        "txt_ids": torch.zeros(ex.text_len, 3, dtype=dtype),
        "timestep": torch.tensor([1.0], dtype=dtype),
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5], dtype=dtype)
    return inputs, DenoiseSpec(timestep_scale=1e-3)


@register_builder("SD3Transformer2DModel")
def _sd3(config: Any, ex: ExampleConfig, dtype: torch.dtype) -> tuple[dict, DenoiseSpec]:
    inputs = {
        "hidden_states": _randn(1, *ex.latent_shape, dtype=dtype, seed=1),
        "encoder_hidden_states": _randn(
            1, ex.text_len, config.joint_attention_dim, dtype=dtype, seed=2
        ),
        "pooled_projections": _randn(1, config.pooled_projection_dim, dtype=dtype, seed=3),
        "timestep": torch.tensor([1000.0], dtype=dtype),
    }
    return inputs, DenoiseSpec()


@register_builder("WanTransformer3DModel")
def _wan(config: Any, ex: ExampleConfig, dtype: torch.dtype) -> tuple[dict, DenoiseSpec]:
    channels, frames, height, width = ex.latent_shape
    inputs = {
        "hidden_states": _randn(1, channels, frames, height, width, dtype=dtype, seed=1),
        "encoder_hidden_states": _randn(1, ex.text_len, config.text_dim, dtype=dtype, seed=2),
        "timestep": torch.tensor([1000.0], dtype=dtype),
    }
    if config.image_dim is not None:
        # Wan2.1 I2V: CLIP image tokens go through added K/V projections.
        inputs["encoder_hidden_states_image"] = _randn(1, 4, config.image_dim, dtype=dtype, seed=4)
    cond = None
    extra = config.in_channels - channels
    if extra > 0:
        # I2V: first-frame latent plus a frame mask, concatenated on channels at every step.
        cond = _randn(1, extra, frames, height, width, dtype=dtype, seed=5)
    return inputs, DenoiseSpec(cond=cond, cond_dim=1)


@register_builder("CogVideoXTransformer3DModel")
def _cogvideox(config: Any, ex: ExampleConfig, dtype: torch.dtype) -> tuple[dict, DenoiseSpec]:
    # CogVideoX takes frames before channels: [B, F, C, H, W].
    inputs = {
        "hidden_states": _randn(1, *ex.latent_shape, dtype=dtype, seed=1),
        "encoder_hidden_states": _randn(1, ex.text_len, config.text_embed_dim, dtype=dtype, seed=2),
        "timestep": torch.tensor([1000.0], dtype=dtype),
    }
    return inputs, DenoiseSpec()


@register_builder("MochiTransformer3DModel")
def _mochi(config: Any, ex: ExampleConfig, dtype: torch.dtype) -> tuple[dict, DenoiseSpec]:
    inputs = {
        "hidden_states": _randn(1, *ex.latent_shape, dtype=dtype, seed=1),
        "encoder_hidden_states": _randn(1, ex.text_len, config.text_embed_dim, dtype=dtype, seed=2),
        "encoder_attention_mask": torch.ones(1, ex.text_len, dtype=torch.bool),
        "timestep": torch.tensor([1000.0], dtype=dtype),
    }
    return inputs, DenoiseSpec()
