"""Shared inputs for liteboost's tests: structured attention inputs and tiny Wan inputs.

Tests get them as fixtures (the suite runs with ``--import-mode=importlib``, where
``from conftest import ...`` does not work). The module-level functions stay importable for
test files not yet moved to the fixtures.
"""

from __future__ import annotations

import math

import pytest
import torch


def structured_qkv(grid, heads=2, dim=12, batch=1, seed=0, text_len=0):
    """Q/K/V whose attention is spatially local, like trained video DiTs (not random Gaussians).

    Each token's query and key are a smooth function of its (frame, row, col) position plus a
    little noise, so a token attends mostly to its 3-D neighbourhood; values are smooth too.
    """
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = grid
    f, h, w = torch.meshgrid(
        torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"
    )
    pos = torch.stack([f, h, w], dim=-1).reshape(-1, 3).float()
    freqs = torch.randn(3, dim // 2, generator=gen) * 0.6
    phase = pos @ freqs
    feats = torch.cat([phase.cos(), phase.sin()], dim=-1) * math.sqrt(dim) * 1.5
    seq = feats.shape[0]
    if text_len:
        feats = torch.cat([feats, torch.randn(text_len, dim, generator=gen)], dim=0)
        seq += text_len

    def noisy():
        base = feats.expand(batch, heads, seq, dim)
        return base + 0.1 * torch.randn(batch, heads, seq, dim, generator=gen)

    v = (
        torch.randn(batch, heads, 1, dim, generator=gen)
        + torch.cat([phase.sin(), phase.cos()], dim=-1).expand(batch, heads, -1, -1)[..., :seq, :]
    )
    if text_len:
        v = torch.cat([v, torch.randn(batch, heads, text_len, dim, generator=gen)], dim=2)
    return noisy(), noisy(), v


def tiny_inputs(grid=(3, 4, 4), batch=1, seed=0):
    """Inputs of the tiny WanTransformer3DModel for a post-patch token grid."""
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = grid
    hidden = torch.randn(batch, 4, frames, 2 * height, 2 * width, generator=gen)
    timestep = torch.full((batch,), 500, dtype=torch.long)
    text = torch.randn(batch, 8, 16, generator=gen)
    return {"hidden_states": hidden, "timestep": timestep, "encoder_hidden_states": text}


# Tiny Wan2.1 I2V: image tokens (CLIP features, here 8-dim) attended by an extra K/V projection.
TINY_I2V = {"image_dim": 8, "added_kv_proj_dim": 24}


def tiny_variant_inputs(variant: str, grid=(3, 4, 4), batch=2, seed=0):
    """Inputs for the other Wan entry points on the tiny transformer.

    "i2v": Wan2.1 I2V: 4 image tokens before the text, and the 512 text tokens diffusers'
    processor assumes when it splits them apart. "ti2v": Wan2.2 TI2V: one timestep per token.
    """
    inputs = tiny_inputs(grid, batch=batch, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if variant == "i2v":
        inputs["encoder_hidden_states"] = torch.randn(batch, 512, 16, generator=gen)
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 4, 8, generator=gen)
    elif variant == "ti2v":
        inputs["timestep"] = torch.randint(0, 1000, (batch, math.prod(grid)), generator=gen)
    else:
        raise ValueError(f"variant={variant!r}; use 'i2v' or 'ti2v'")
    return inputs


def vae_latents(frames: int, batch: int = 1) -> torch.Tensor:
    """Latents of the tiny AutoencoderKLWan: [batch, 4, frames, 2, 2]."""
    return torch.randn(batch, 4, frames, 2, 2, generator=torch.Generator().manual_seed(frames))


def vae_pixels(frames: int, batch: int = 1) -> torch.Tensor:
    """A video in [-1, 1] for the tiny AutoencoderKLWan: [batch, 3, frames, 16, 16]."""
    gen = torch.Generator().manual_seed(frames)
    return torch.rand(batch, 3, frames, 16, 16, generator=gen) * 2 - 1


@pytest.fixture
def qkv_factory():
    """:func:`structured_qkv`: spatially local Q/K/V for a latent grid."""
    return structured_qkv


@pytest.fixture
def wan_inputs():
    """:func:`tiny_inputs`: inputs of the tiny Wan transformer for a token grid."""
    return tiny_inputs


@pytest.fixture
def wan_variant_inputs():
    """:func:`tiny_variant_inputs`: Wan2.1 I2V / Wan2.2 TI2V inputs for the tiny transformer."""
    return tiny_variant_inputs


@pytest.fixture
def tiny_i2v() -> dict:
    """Config overrides that make the tiny transformer a Wan2.1 I2V model."""
    return dict(TINY_I2V)


@pytest.fixture
def vae_latents_of():
    """:func:`vae_latents`: latents of the tiny AutoencoderKLWan for a frame count."""
    return vae_latents


@pytest.fixture
def vae_pixels_of():
    """:func:`vae_pixels`: a video in [-1, 1] for the tiny AutoencoderKLWan."""
    return vae_pixels


def explain_graphs(model, inputs: dict):
    """``torch._dynamo.explain`` of one no-grad forward, from a fresh dynamo state.

    Its ``graph_count`` / ``graph_break_count`` are what the compile tests compare with the
    stock model's; ``graphs`` are the captured FX graphs and ``break_reasons`` say why a graph
    was cut.
    """
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(model)(**inputs)


@pytest.fixture
def explained():
    """:func:`explain_graphs`: dynamo's account of one traced forward."""
    return explain_graphs


@pytest.fixture(scope="session")
def cpu_kernel():
    """liteboost's C++ CPU extension (built or loaded from the cache). The one policy for a
    missing C++ toolchain: a test that needs the extension is skipped, naming the compiler."""
    import shutil

    from torch.utils.cpp_extension import get_cxx_compiler

    from liteboost.ops.cpu_extension import load_cpu_kernel

    module = load_cpu_kernel()
    if module is None:
        compiler = get_cxx_compiler()
        found = "not found" if shutil.which(compiler) is None else "found, but the build failed"
        pytest.skip(
            f"no C++ toolchain to build liteboost's CPU kernel extension: compiler {compiler!r} "
            f"{found} (the 'CPU kernel extension unavailable' warning has the build's error)"
        )
    return module
