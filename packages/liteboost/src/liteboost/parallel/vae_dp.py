"""Temporal data parallelism for AutoencoderKLWan decode and encode: one span of frames per rank.

Wan's decoder is causal in time: it decodes one latent frame at a time and each causal
convolution keeps the last two frames of its input. Latent frame t therefore depends on at most
``R`` earlier latent frames (the causal receptive field, summed over the convolution chain and
divided by the temporal upsampling reached at each layer). A rank that owns latent frames
[a, b) decodes the window [a - R, b) from scratch and keeps only the frames of [a, b): they are
computed from exactly the same inputs as in a single-process decode. The window's own first
frame takes diffusers' first-chunk path (one output frame); the frames it keeps are all past the
receptive field of that special case.

Encode is the mirror image: Wan encodes frame 0 alone, then chunks of 4 frames, one latent frame
per chunk. A rank owning latent frames [a, b) encodes from pixel frame 4 * (a - R_enc), which
the encoder treats as a lone first frame, after which its chunks line up with the global ones.

Bit-identical, and why that needs more than the receptive field. Equal inputs give equal bits
only when every operation also runs on tensors of the same shape, because CPU kernels pick their
code path by shape: a GEMM with few columns takes another BLAS kernel (another summation order)
than a wide one, and element-wise kernels round their vectorised body and scalar tail
differently. Inside the decoder and encoder every call sees one frame or one 4-frame chunk, so
window and full clip match call for call. Two 1x1x1 convolutions do not: ``post_quant_conv``
runs on all latent frames before the decode loop and ``quant_conv`` on all latent frames after
the encode loop, as one GEMM whose column count is T * h * w (ATen's ``slow_conv3d`` on CPU). On
a window of 2 latent frames that GEMM rounds differently from the full clip's 5 (measured on
AVX-512 and on AVX2-only CPUs alike, about 1e-6 after the decoder), which is what broke exact
equality at 2 and 3 ranks. At real sizes ATen may even pick another backend by T: with more
than one thread it runs such a float conv on oneDNN only when N * C * T * H exceeds 20480
(``ConvParams::use_mkldnn`` in ATen's ``Convolution.cpp``), i.e. past 21 latent frames for a
480p Wan latent (16 x 60 x 104 per frame).

So the ranks run those two convolutions on the whole clip, as the stock code does: decode replaces
``post_quant_conv``'s output on the window by the window's slice of ``post_quant_conv`` over all of
``z`` (computed inside the stock decode, where weight offloading hooks have put the weights on the
device), and encode skips ``quant_conv`` in the windows and applies it once to the gathered encoder
output. Batch slicing (``use_slicing``) is mirrored: one sample at a time, as the stock code does.

The guarantee is therefore: bit-identical to the stock decode / encode run in a process with the
same intra-op thread count (``torch.get_num_threads()``) on the same machine. Across thread
counts stock itself may differ in the last bits (ATen chooses between oneDNN and its native
convolution partly by thread count, e.g. for 1x1 filters), and npu-core's launcher gives each
rank ``threads_per_process(world_size)`` threads (usable CPUs / ranks). With VAE tiling active
(``enable_tiling()`` and frames larger than a tile) the 1x1 convolutions run per spatial tile in
stock and are not mirrored here: the result then matches stock to float rounding, not bit for
bit.

The exchange uses equal-size all_gather (gloo refuses uneven sizes): every rank pads its frames
to the largest span and the padding is cut after the gather.

Honest limit: R grows with decoder depth (about 30 latent frames for the tiny test VAE, more for
Wan2.1), so a speed-up needs clips much longer than R per rank; shorter clips are still correct,
the windows then simply start at frame 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def temporal_factor(vae: Any) -> int:
    """Output frames per latent frame after the first (4 for Wan)."""
    return 2 ** sum(bool(x) for x in vae.config.temperal_downsample)


def decoder_receptive_field(vae: Any) -> int:
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
            history = int(module._padding[4])
            field += history / scale
            if id(module) in upsample_convs:
                scale *= 2
    # +1 covers the second window frame, whose upsampler history is zeros instead of frame 0.
    return math.ceil(field) + 1


def encoder_receptive_field(vae: Any) -> int:
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


def _per_sample(vae: Any, batch: int) -> bool:
    """Whether the stock decode / encode runs one sample at a time (diffusers' ``use_slicing``)."""
    return bool(getattr(vae, "use_slicing", False)) and batch > 1


@contextlib.contextmanager
def _output_replaced(
    module: torch.nn.Module, replace: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Within the block, ``module(x)`` returns ``replace(x, module's own output)``."""
    handle = module.register_forward_hook(lambda _mod, args, out: replace(args[0], out))
    try:
        yield
    finally:
        handle.remove()


def decode_span(
    vae: Any, z: torch.Tensor, span: Span, decode_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The output frames of latents [span.start, span.stop), decoded from the span's window.

    Bit-identical to the same frames of ``decode_fn(z)`` in this process: the decoder runs on the
    window, while ``post_quant_conv`` runs on all of ``z`` (see the module docstring).

    Args:
        vae: the AutoencoderKLWan.
        z: all latents [B, C, T, h, w].
        span: the latent frames to return and the window to decode them from.
        decode_fn: the stock decode, ``decode_fn(z) -> frames [B, 3, T_out, H, W]``.

    Returns:
        [B, 3, n, H, W] with n output frames of the span (0 for an empty span).
    """
    if span.stop <= span.start:
        # No frames, but the gather needs a tensor of the right shape and dtype.
        return decode_fn(z[:, :, :1])[:, :, :0]
    if _per_sample(vae, z.shape[0]):
        return torch.cat([decode_span(vae, one, span, decode_fn) for one in z.split(1)])
    factor = temporal_factor(vae)
    window = z[:, :, span.window : span.stop]

    def whole_clip(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if inp.shape != window.shape:  # a spatial tile of a tiled decode: not mirrored
            return out
        return vae.post_quant_conv.forward(z)[:, :, span.window : span.stop]

    with _output_replaced(vae.post_quant_conv, whole_clip):
        frames = decode_fn(window)
    begin = _output_index(span.start - span.window, factor)
    count = _output_index(span.stop, factor) - _output_index(span.start, factor)
    return frames[:, :, begin : begin + count]


def encode_span(
    vae: Any, x: torch.Tensor, span: Span, encode_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Encoder output (before ``quant_conv``) of latents [span.start, span.stop), from its window.

    Pass the gathered spans through :func:`finish_encode` to get the stock encode's moments.

    Args:
        vae: the AutoencoderKLWan.
        x: all pixels [B, 3, T, H, W], T = 1 + 4k.
        span: latent frames to return and the window (in latent frames) to encode them from.
        encode_fn: the stock encode to moments, ``encode_fn(x) -> [B, 2 z, T_lat, h, w]``; it
            runs with ``vae.quant_conv`` skipped.

    Returns:
        [B, 2 z, span.stop - span.start, h, w].
    """
    factor = temporal_factor(vae)
    with _output_replaced(vae.quant_conv, lambda inp, _out: inp):
        if span.stop <= span.start:
            return encode_fn(x[:, :, :1])[:, :, :0]
        # Window from pixel frame factor * window: encoded as a lone first frame, then chunks
        # aligned with the global ones (local latent j is global latent window + j).
        first = factor * span.window
        moments = encode_fn(x[:, :, first : 1 + factor * (span.stop - 1)])
    return moments[:, :, span.start - span.window : span.stop - span.window]


def finish_encode(vae: Any, encoded: torch.Tensor) -> torch.Tensor:
    """``quant_conv`` over the whole clip's encoder output, batched as the stock encode does."""
    if _per_sample(vae, encoded.shape[0]):
        return torch.cat([vae.quant_conv(one) for one in encoded.split(1)])
    return vae.quant_conv(encoded)


def _gather_frames(
    local: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """all_gather of [B, C, T_r, H, W] with per-rank T_r, by padding to max(T_r)."""
    longest = max(counts)
    if local.shape[2] < longest:
        pad = local.new_zeros(*local.shape[:2], longest - local.shape[2], *local.shape[3:])
        local = torch.cat([local, pad], dim=2)
    local = local.contiguous()
    parts = [torch.empty(local.shape, dtype=local.dtype, device=local.device) for _ in counts]
    dist.all_gather(parts, local, group=group)
    return torch.cat([part[:, :, :count] for part, count in zip(parts, counts, strict=True)], dim=2)


def choose_decode_mode(
    vae: Any, z: torch.Tensor, world_size: int, receptive_field: int | None = None
) -> str:
    """ "spatial" or "temporal": the mode whose busiest rank does less decoder work for ``z``.

    Temporal: the longest window (span plus causal receptive field) over all latent frames.
    Spatial: the replicated share (``conv_in`` and the middle block at latent resolution) plus
    one slab of rows of the rest. Spatial needs a decoder that is local after its middle block,
    at least one latent row per rank and no VAE tiling (tiles are spatial already); an explicit
    ``receptive_field`` asks for the temporal mode.
    """
    from liteboost.parallel import vae_spatial

    if world_size <= 1:
        return "temporal"
    frames, rows = z.shape[2], z.shape[-2]
    field = decoder_receptive_field(vae) if receptive_field is None else receptive_field
    spans = plan_spans(frames, world_size, field)
    temporal = max(s.stop - s.window for s in spans) / frames
    plan = vae_spatial.spatial_plan(vae)
    if (
        plan is None
        or receptive_field is not None
        or rows < world_size
        or getattr(vae, "use_tiling", False)
    ):
        return "temporal"
    largest = max(b - a for a, b in vae_spatial.plan_rows(rows, world_size))
    spatial = plan.replicated_share + (1 - plan.replicated_share) * largest / rows
    return "spatial" if spatial < temporal else "temporal"


def parallel_decode(
    vae: Any,
    z: torch.Tensor,
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    receptive_field: int | None = None,
    mode: str | None = None,
) -> torch.Tensor:
    """Decode latents ``z`` [B, C, T, h, w] across the ranks of ``group``; all ranks get all frames.

    Args:
        vae: the AutoencoderKLWan.
        z: latents, identical on every rank.
        decode_fn: the single-process decode, ``decode_fn(z) -> frames [B, 3, T_out, H, W]``.
        group: process group (None = default).
        receptive_field: override of :func:`decoder_receptive_field` (smaller is faster but no
            longer exact); implies the temporal mode.
        mode: "temporal" (spans of frames, bit-identical), "spatial" (row slabs with halo
            exchange, exact up to float rounding: ``liteboost.parallel.vae_spatial``) or None
            to pick by shape (:func:`choose_decode_mode`).
    """
    from liteboost.parallel import vae_spatial

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if mode is None:
        mode = choose_decode_mode(vae, z, world, receptive_field)
    if mode == "spatial":
        return vae_spatial.spatial_decode(vae, z, decode_fn, group)
    if mode != "temporal":
        raise ValueError(f"mode={mode!r}; use 'temporal', 'spatial' or None (by shape)")
    field = decoder_receptive_field(vae) if receptive_field is None else receptive_field
    factor = temporal_factor(vae)
    spans = plan_spans(z.shape[2], world, field)
    counts = [_output_index(s.stop, factor) - _output_index(s.start, factor) for s in spans]
    return _gather_frames(decode_span(vae, z, spans[rank], decode_fn), counts, group)


def parallel_encode(
    vae: Any,
    x: torch.Tensor,
    encode_fn: Callable[[torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    receptive_field: int | None = None,
) -> torch.Tensor:
    """Encode video ``x`` [B, 3, T, H, W] across ranks; every rank gets the full moments.

    Args:
        vae: the AutoencoderKLWan.
        x: pixels, identical on every rank; T = 1 + 4k as Wan expects.
        encode_fn: the single-process encode to moments, ``encode_fn(x) -> [B, 2 z, T_lat, h, w]``
            (run with ``vae.quant_conv`` skipped; the ranks apply it once to the gathered clip).
        group: process group (None = default).
        receptive_field: override of :func:`encoder_receptive_field`.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    field = encoder_receptive_field(vae) if receptive_field is None else receptive_field
    latents = 1 + (x.shape[2] - 1) // temporal_factor(vae)
    spans = plan_spans(latents, world, field)
    counts = [s.stop - s.start for s in spans]
    encoded = _gather_frames(encode_span(vae, x, spans[rank], encode_fn), counts, group)
    return finish_encode(vae, encoded)
