"""VAE temporal data parallelism without ranks: every rank's span equals stock, bit for bit.

A rank's share is computed by ``decode_span`` / ``encode_span`` on its window; concatenating all
spans here is what the all_gather does across ranks (``test_parallel.py`` runs the real ranks).
Stock and spans run in this one process, at its thread count, so the comparison does not depend on
the ISA, the thread count or the machine.
"""

from __future__ import annotations

import functools

import pytest
import torch

from liteboost.parallel.vae_dp import (
    decode_span,
    decoder_receptive_field,
    encode_span,
    encoder_receptive_field,
    finish_encode,
    plan_spans,
)
from liteboost.tiny import build_tiny_vae


@functools.cache
def _vae():
    return build_tiny_vae()


@functools.cache
@torch.no_grad()
def _stock_decode(frames: int, vae_latents) -> torch.Tensor:
    return _vae().decode(vae_latents(frames)).sample


def _decode(x: torch.Tensor) -> torch.Tensor:
    return _vae().decode(x).sample


def _encode(x: torch.Tensor) -> torch.Tensor:
    return _vae().encode(x).latent_dist.parameters


def _long_clip() -> int:
    # Longer than the receptive field R: with one latent frame per rank, the last ranks decode
    # from windows that start past frame 0.
    return decoder_receptive_field(_vae()) + 3


def test_vae_spans_cover_every_frame_once():
    for frames in (1, 2, 7, 21):
        for world in (1, 2, 3):
            spans = plan_spans(frames, world, receptive_field=4)
            owned = [t for s in spans for t in range(s.start, s.stop)]
            assert owned == list(range(frames))
            assert all(s.window == max(0, s.start - 4) for s in spans)


@torch.no_grad()
@pytest.mark.parametrize(("frames", "world"), [(1, 2), (5, 2), (5, 3), (9, 2), (9, 3)])
def test_decode_spans_equal_stock_decode_bit_for_bit(frames, world, vae_latents_of):
    """Windows shorter than the clip (2 of 5 latents at 3 ranks) give the stock bits."""
    vae_latents = vae_latents_of
    spans = plan_spans(frames, world, decoder_receptive_field(_vae()))
    z = vae_latents(frames)
    parts = [decode_span(_vae(), z, span, _decode) for span in spans]
    assert torch.equal(torch.cat(parts, dim=2), _stock_decode(frames, vae_latents))


@torch.no_grad()
def test_decode_span_from_a_window_past_frame_zero_equals_stock(vae_latents_of):
    """A window starting after frame 0 (first-chunk path on another frame) keeps exact frames."""
    vae_latents = vae_latents_of
    frames = _long_clip()
    span = plan_spans(frames, frames, decoder_receptive_field(_vae()))[-1]
    assert span.window > 0
    part = decode_span(_vae(), vae_latents(frames), span, _decode)
    assert torch.equal(part, _stock_decode(frames, vae_latents)[:, :, -part.shape[2] :])


@torch.no_grad()
def test_decode_spans_follow_batch_slicing(vae_latents_of):
    """With ``enable_slicing()`` stock decodes one sample at a time; the spans do the same."""
    vae_latents = vae_latents_of
    vae = build_tiny_vae()
    vae.enable_slicing()
    z = vae_latents(5, batch=2)
    stock = vae.decode(z).sample
    spans = plan_spans(5, 3, decoder_receptive_field(vae))
    parts = [decode_span(vae, z, span, lambda x: vae.decode(x).sample) for span in spans]
    assert torch.equal(torch.cat(parts, dim=2), stock)


@torch.no_grad()
@pytest.mark.parametrize(("frames", "world"), [(1, 2), (9, 2), (9, 3), (17, 2)])
def test_encode_spans_equal_stock_encode_bit_for_bit(frames, world, vae_pixels_of):
    """quant_conv runs once over the gathered clip, so short windows give the stock bits."""
    vae_pixels = vae_pixels_of
    x = vae_pixels(frames)
    spans = plan_spans(1 + (frames - 1) // 4, world, encoder_receptive_field(_vae()))
    parts = [encode_span(_vae(), x, span, _encode) for span in spans]
    assert torch.equal(finish_encode(_vae(), torch.cat(parts, dim=2)), _encode(x))


@torch.no_grad()
def test_receptive_field_bounds_the_influence_of_frame_zero(vae_latents_of):
    """Perturbing latent frame 0 changes no frame decoded from latent R or later."""
    vae_latents = vae_latents_of
    field = decoder_receptive_field(_vae())
    frames = _long_clip()
    base = _stock_decode(frames, vae_latents)
    z = vae_latents(frames)
    z[:, :, 0] += 1.0
    moved = _decode(z)
    first_safe = 1 + 4 * (field - 1)
    assert torch.equal(moved[:, :, first_safe:], base[:, :, first_safe:])
    # ... and the bound is tight to within the one-frame margin: R - 2 is still affected.
    assert not torch.equal(moved[:, :, : first_safe - 4], base[:, :, : first_safe - 4])


def test_decode_mode_is_picked_by_shape():
    """Spatial for frames with rows to split; temporal when rows, tiling or an override say so."""
    from liteboost.parallel.vae_dp import choose_decode_mode
    from liteboost.parallel.vae_spatial import plan_rows, spatial_plan

    vae = build_tiny_vae()
    plan = spatial_plan(vae)
    assert plan is not None and all(radius == 1 for _, radius in plan.convs)
    assert 0 < plan.replicated_share < 0.5
    assert plan_rows(7, 3) == [(0, 3), (3, 5), (5, 7)]
    wide, one_row = torch.zeros(1, 4, 3, 12, 10), torch.zeros(1, 4, 3, 1, 10)
    assert choose_decode_mode(vae, wide, 2) == "spatial"
    assert choose_decode_mode(vae, one_row, 2) == "temporal"  # fewer rows than ranks
    assert choose_decode_mode(vae, wide, 2, receptive_field=2) == "temporal"
    assert choose_decode_mode(vae, wide, 1) == "temporal"
    vae.enable_tiling()
    assert choose_decode_mode(vae, wide, 2) == "temporal"
