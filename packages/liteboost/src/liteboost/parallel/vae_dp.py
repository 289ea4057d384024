"""Temporal data parallelism for AutoencoderKLWan decode and encode: one span of frames per rank.

Wan's decoder is causal in time: it decodes one latent frame at a time and each causal
convolution keeps the last two frames of its input. Latent frame t therefore depends on at most
``R`` earlier latent frames (the causal receptive field, summed over the convolution chain and
divided by the temporal upsampling reached at each layer). A rank that owns latent frames
[a, b) decodes the window [a - R, b) from scratch and keeps only the frames of [a, b): they are
computed from exactly the same inputs as in a single-process decode, so they are bit-identical.
The window's own first frame takes diffusers' first-chunk path (one output frame); the frames
it keeps are all past the receptive field of that special case.

The exchange uses equal-size all_gather (gloo refuses uneven sizes): every rank pads its frames
to the largest span and the padding is cut after the gather.

Encode is the mirror image: Wan encodes frame 0 alone, then chunks of 4 frames, one latent frame
per chunk. A rank owning latent frames [a, b) encodes from pixel frame 4 * (a - R_enc), which
the encoder treats as a lone first frame, after which its chunks line up with the global ones.

Honest limit: R grows with decoder depth (about 30 latent frames for the tiny test VAE, more for
Wan2.1), so a speed-up needs clips much longer than R per rank; shorter clips are still correct,
the windows then simply start at frame 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


def temporal_factor(vae) -> int:
    """Output frames per latent frame after the first (4 for Wan)."""
    return 2 ** sum(bool(x) for x in vae.config.temperal_downsample)


def decoder_receptive_field(vae) -> int:
    """Latent frames before t that can influence the frames decoded from latent t.

    Walks the decoder in execution order: every causal convolution with temporal history h
    (h = 2 for kernel 3) adds h / s latent frames, s being the temporal upsampling reached at
    that layer; a 3-D upsampler doubles s after its own time convolution.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    upsample_convs = {
        id(m.time_conv)
        for m in vae.decoder.modules()
        if isinstance(m, WanResample) and m.mode == "upsample3d"
    }
    scale, field = 1, 0.0
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            history = module._padding[4]
            field += history / scale
            if id(module) in upsample_convs:
                scale *= 2
    # +1 covers the second window frame, whose upsampler history is zeros instead of frame 0.
    return math.ceil(field) + 1


def encoder_receptive_field(vae) -> int:
    """Latent frames (4-frame chunks) before t that can influence latent t in an encode.

    Every causal convolution with history h at temporal downsampling s spans h * s pixel
    frames, i.e. h * s / 4 chunks; a 3-D downsampler (history: its cached frame plus its own
    stride-2 kernel, counted as 2) halves the frame rate after it.
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    down_convs = {
        id(m.time_conv)
        for m in vae.encoder.modules()
        if isinstance(m, WanResample) and m.mode == "downsample3d"
    }
    chunk = 2 ** sum(bool(x) for x in vae.config.temperal_downsample)
    scale, field = 1, 0.0
    for module in vae.encoder.modules():
        if isinstance(module, WanCausalConv3d):
            if id(module) in down_convs:
                field += 2 * scale / chunk
                scale *= 2
            else:
                field += module._padding[4] * scale / chunk
    return math.ceil(field) + 1


@dataclass(frozen=True)
class Span:
    """Latent frames [start, stop) owned by a rank, decoded from window [window, stop)."""

    start: int
    stop: int
    window: int


def plan_spans(num_frames: int, world_size: int, receptive_field: int) -> list[Span]:
    """Contiguous, near-equal latent spans per rank (empty spans when frames < ranks)."""
    if num_frames < 1:
        raise ValueError(f"num_frames={num_frames} must be >= 1")
    base, extra = divmod(num_frames, world_size)
    spans, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        spans.append(Span(start, stop, max(0, start - receptive_field)))
        start = stop
    return spans


def _output_index(latent: int, factor: int) -> int:
    """First output frame of latent frame ``latent`` within a decode that starts at latent 0."""
    return 0 if latent == 0 else 1 + factor * (latent - 1)


def _gather_frames(local: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """all_gather of [B, C, T_r, H, W] with per-rank T_r, by padding to max(T_r)."""
    longest = max(counts)
    if local.shape[2] < longest:
        pad = local.new_zeros(*local.shape[:2], longest - local.shape[2], *local.shape[3:])
        local = torch.cat([local, pad], dim=2)
    local = local.contiguous()
    parts = [torch.empty(local.shape, dtype=local.dtype, device=local.device) for _ in counts]
    dist.all_gather(parts, local, group=group)
    return torch.cat([part[:, :, :count] for part, count in zip(parts, counts, strict=True)], dim=2)


def parallel_decode(
    vae, z: torch.Tensor, decode_fn, group=None, receptive_field: int | None = None
):
    """Decode latents ``z`` [B, C, T, h, w] across the ranks of ``group``; all ranks get all frames.

    Args:
        vae: the AutoencoderKLWan.
        z: latents, identical on every rank.
        decode_fn: the single-process decode, ``decode_fn(z) -> frames [B, 3, T_out, H, W]``.
        group: process group (None = default).
        receptive_field: override of :func:`decoder_receptive_field` (smaller is faster but no
            longer exact).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    field = decoder_receptive_field(vae) if receptive_field is None else receptive_field
    factor = temporal_factor(vae)
    spans = plan_spans(z.shape[2], world, field)
    counts = [_output_index(s.stop, factor) - _output_index(s.start, factor) for s in spans]
    mine = spans[rank]
    if mine.stop > mine.start:
        frames = decode_fn(z[:, :, mine.window : mine.stop])
        begin = _output_index(mine.start - mine.window, factor)
        local = frames[:, :, begin : begin + counts[rank]]
    else:
        # No frames here, but the gather still needs a tensor of the right shape and dtype.
        probe = decode_fn(z[:, :, :1])
        local = probe[:, :, :0]
    return _gather_frames(local, counts, group)


def parallel_encode(
    vae, x: torch.Tensor, encode_fn, group=None, receptive_field: int | None = None
):
    """Encode video ``x`` [B, 3, T, H, W] across ranks; every rank gets the full moments.

    Args:
        vae: the AutoencoderKLWan.
        x: pixels, identical on every rank; T = 1 + 4k as Wan expects.
        encode_fn: the single-process encode to moments, ``encode_fn(x) -> [B, 2 z, T_lat, h, w]``.
        group: process group (None = default).
        receptive_field: override of :func:`encoder_receptive_field`.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    field = encoder_receptive_field(vae) if receptive_field is None else receptive_field
    factor = temporal_factor(vae)
    latents = 1 + (x.shape[2] - 1) // factor
    spans = plan_spans(latents, world, field)
    counts = [s.stop - s.start for s in spans]
    mine = spans[rank]
    if mine.stop > mine.start:
        # Window from pixel frame factor * window: encoded as a lone first frame, then chunks
        # aligned with the global ones (local latent j is global latent window + j).
        first = factor * mine.window
        moments = encode_fn(x[:, :, first : 1 + factor * (mine.stop - 1)])
        local = moments[:, :, mine.start - mine.window : mine.stop - mine.window]
    else:
        local = encode_fn(x[:, :, :1])[:, :, :0]
    return _gather_frames(local, counts, group)
