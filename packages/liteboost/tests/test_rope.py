"""Cached RoPE equals diffusers' WanRotaryPosEmbed + WanAttnProcessor rotation."""

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from liteboost.ops.rope import apply_rope, rope_tables


def _diffusers_rotate(x, freqs_cos, freqs_sin):
    # The exact arithmetic of diffusers' WanAttnProcessor.apply_rotary_emb.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@pytest.mark.parametrize(("head_dim", "grid"), [(12, (3, 4, 4)), (128, (5, 30, 52))])
def test_rope_matches_diffusers_fp32_within_1e6(head_dim, grid):
    """Same tables and rotated values as diffusers, to 1e-6, at tiny and 480p sizes."""
    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
    frames, height, width = grid
    cos, sin = rope(torch.zeros(1, 1, frames, 2 * height, 2 * width))
    tables = rope_tables(head_dim, grid)
    torch.testing.assert_close(tables[0], cos.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(tables[1], sin.float(), atol=1e-6, rtol=0)
    x = torch.randn(2, frames * height * width, 2, head_dim)
    expect = _diffusers_rotate(x, cos, sin)
    got = apply_rope(x, tables.freqs)
    assert (got - expect).abs().max().item() < 1e-6 * max(1.0, x.abs().max().item())


def test_rope_bf16_matches_diffusers_rounding():
    """In bf16 both compute in higher precision and round once: results agree to bf16 rounding."""
    rope = WanRotaryPosEmbed(12, (1, 2, 2), max_seq_len=32)
    cos, sin = rope(torch.zeros(1, 1, 3, 8, 8))
    x = torch.randn(1, 48, 2, 12).bfloat16()
    expect = _diffusers_rotate(x, cos, sin)
    got = apply_rope(x, rope_tables(12, (3, 4, 4)).freqs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expect.float(), atol=1e-2, rtol=1e-2)
    assert (got != expect).float().mean() < 0.02


def test_tables_are_cached_per_grid_dtype_and_device():
    a = rope_tables(12, (3, 4, 4))
    assert rope_tables(12, (3, 4, 4)) is a
    assert rope_tables(12, (3, 4, 5)) is not a
    assert rope_tables(12, (3, 4, 4), dtype=torch.float64) is not a


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim=13"):
        rope_tables(13, (1, 2, 2))
