"""Spatial parallelism for AutoencoderKLWan decode: one slab of rows per rank, halo exchange.

Where the time goes in Wan's decoder: every level after the middle block runs a few 3x3(x3)
convolutions, the channel count halves as the resolution doubles, so each of the four levels
costs about the same and the middle block at latent resolution is a small share. Those levels are
local in space (3x3 convolutions, nearest upsampling, per-pixel RMS norm and activations), but
the middle block holds a self-attention over every pixel of a frame: its output depends on the
whole frame. So:

1. every rank runs ``post_quant_conv``, ``conv_in`` and the middle block on the whole latent
   frame (replicated, cheap at latent resolution);
2. the middle block's output is cut to this rank's rows (near-equal row slabs);
3. before every convolution with a spatial kernel (radius p rows), each rank sends its first p
   rows to the rank above and its last p rows to the rank below (``isend``/``irecv``) and
   prepends / appends what it receives; the convolution's own zero padding then only acts at
   the true image border, and the p extra output rows per received halo are cut off again.
   The causal convolutions' cached frames (``feat_cache``) are haloed together with the input,
   in one exchange, so time caching is unchanged;
4. the slabs are gathered along the height.

The halo is sized from the receptive field of each convolution (its kernel), at the resolution
where it runs, so the result is exact: every output row sees exactly the inputs it sees in a
single-process decode. Not bit for bit: a convolution over a slab is another shape for the CPU
kernels than over the frame, and they may sum in another order (float rounding, about 1e-6 for
fp32 outputs in [-1, 1]). The temporal mode (``vae_dp``) is bit-identical; this one is faster
when the frame has many more rows per rank than the clip has latent frames beyond the causal
receptive field. :func:`choose_decode_mode` picks by shape.

What would break exactness is refused, not approximated: a decoder with attention, strided or
dilated convolutions or group norms after the middle block gets ``None`` from
:func:`spatial_plan` and decodes in the temporal mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_LOCAL_MODULES = (
    "WanUpBlock",
    "WanResidualUpBlock",
    "WanResidualBlock",
    "WanResample",
    "WanUpsample",
    "WanCausalConv3d",
    "WanRMS_norm",
    "DupUp3D",
    "Conv2d",
    "Conv3d",
    "Sequential",
    "ModuleList",
    "SiLU",
    "Dropout",
    "Identity",
)


@dataclass(frozen=True)
class SpatialPlan:
    """Convolutions that need a halo after the middle block, and their row radius.

    Attributes:
        convs: (module, radius in rows) for every convolution with a spatial kernel.
        replicated_share: estimated share of the decoder's work done before the cut (run on
            every rank): conv FLOPs at latent resolution over all conv FLOPs.
    """

    convs: tuple[tuple[torch.nn.Module, int], ...]
    replicated_share: float


def _conv_geometry(module: Any) -> tuple[int, int] | None:
    """(row radius, FLOPs per output pixel) of a 'same' stride-1 conv; None if not one."""
    kernel_h, kernel_w = module.kernel_size[-2], module.kernel_size[-1]
    if any(s != 1 for s in module.stride) or any(d != 1 for d in module.dilation):
        return None
    if type(module).__name__ == "WanCausalConv3d":
        pad_w, _, pad_h, _ = module._padding[:4]
    else:
        pad_h, pad_w = module.padding[-2], module.padding[-1]
    if (kernel_h - 1) != 2 * pad_h or (kernel_w - 1) != 2 * pad_w:
        return None
    flops = module.in_channels * module.out_channels * int(torch.tensor(module.kernel_size).prod())
    return pad_h, flops // module.groups


def spatial_plan(vae: Any) -> SpatialPlan | None:
    """The halo plan of ``vae.decoder``; None when something after the middle block is not local.

    Walks the modules after the middle block (up blocks, head); every module must be of a kind
    known to be local in space, every convolution stride 1, 'same'-padded.
    """
    decoder = vae.decoder
    if not hasattr(decoder, "mid_block") or not hasattr(decoder, "up_blocks"):
        return None
    tail = [*decoder.up_blocks.modules(), decoder.norm_out, decoder.conv_out]
    convs, tail_flops, scale = [], 0.0, 1.0
    for module in tail:
        name = type(module).__name__
        if name not in _LOCAL_MODULES:
            return None
        if name == "WanUpsample":
            factor = module.scale_factor
            scale *= float(factor[-1] if isinstance(factor, tuple) else factor) ** 2
        if isinstance(module, torch.nn.Conv2d | torch.nn.Conv3d):
            geometry = _conv_geometry(module)
            if geometry is None:
                return None
            radius, flops = geometry
            tail_flops += flops * scale
            if radius > 0:
                convs.append((module, radius))
    head_flops = 0.0
    for module in [decoder.conv_in, *decoder.mid_block.modules()]:
        if isinstance(module, torch.nn.Conv2d | torch.nn.Conv3d):
            head_flops += (
                module.in_channels
                * module.out_channels
                * int(torch.tensor(module.kernel_size).prod())
            )
    return SpatialPlan(tuple(convs), head_flops / (head_flops + tail_flops))


def plan_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Near-equal contiguous row slabs ``[start, stop)`` per rank."""
    base, extra = divmod(rows, world_size)
    slabs, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        slabs.append((start, stop))
        start = stop
    return slabs


class HaloExchange:
    """Row halos between neighbouring ranks of ``group`` (rank r holds the r-th slab)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        whole = group if group is not None else dist.group.WORLD
        assert whole is not None, "torch.distributed is not initialised"
        self.above = dist.get_global_rank(whole, self.rank - 1) if self.rank > 0 else None
        below = self.rank + 1
        self.below = dist.get_global_rank(whole, below) if below < self.world else None

    def extend(self, x: torch.Tensor, radius: int) -> tuple[torch.Tensor, int, int]:
        """``x`` with ``radius`` rows (dim -2) from each neighbour; returns (x, top, bottom)."""
        ops, top, bottom = [], None, None
        if self.above is not None:
            top = torch.empty_like(x[..., :radius, :].contiguous())
            ops += [
                dist.isend(x[..., :radius, :].contiguous(), self.above, group=self.group),
                dist.irecv(top, self.above, group=self.group),
            ]
        if self.below is not None:
            bottom = torch.empty_like(x[..., -radius:, :].contiguous())
            ops += [
                dist.isend(x[..., -radius:, :].contiguous(), self.below, group=self.group),
                dist.irecv(bottom, self.below, group=self.group),
            ]
        for op in ops:
            if op is not None:
                op.wait()
        parts = [p for p in (top, x, bottom) if p is not None]
        extended = torch.cat(parts, dim=-2) if len(parts) > 1 else x
        return extended, radius if top is not None else 0, radius if bottom is not None else 0


@contextlib.contextmanager
def _halo_hooks(plan: SpatialPlan, exchange: HaloExchange) -> Iterator[None]:
    handles = []
    for conv, radius in plan.convs:
        sides: list[tuple[int, int]] = []

        def pre(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            radius: int = radius,
            sides: list[tuple[int, int]] = sides,
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            x, rest = args[0], args[1:]
            cache = rest[0] if rest else kwargs.get("cache_x")
            if isinstance(cache, torch.Tensor):
                # Halo the cached frames together with the input: one exchange, same rows.
                frames = cache.shape[2]
                both, top, bottom = exchange.extend(torch.cat([cache.to(x.device), x], 2), radius)
                sides.append((top, bottom))
                return (both[:, :, frames:], both[:, :, :frames]), {}
            x, top, bottom = exchange.extend(x, radius)
            sides.append((top, bottom))
            return (x, *rest), kwargs

        def post(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            out: torch.Tensor,
            sides: list[tuple[int, int]] = sides,
        ) -> torch.Tensor:
            top, bottom = sides.pop()
            return out[..., top : out.shape[-2] - bottom, :]

        handles.append(conv.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(conv.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def decode_rows(
    vae: Any,
    z: torch.Tensor,
    plan: SpatialPlan,
    exchange: HaloExchange,
    slabs: list[tuple[int, int]],
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """This rank's output rows of ``decode_fn(z)``; every rank of ``exchange`` must call it.

    The middle block's output is cut to the rank's slab (``slabs[exchange.rank]``, latent rows);
    the hooks exchange halos before each spatial convolution after it.
    """
    start, stop = slabs[exchange.rank]

    def cut(_module: torch.nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out[..., start:stop, :]

    handle = vae.decoder.mid_block.register_forward_hook(cut)
    try:
        with _halo_hooks(plan, exchange):
            return decode_fn(z)
    finally:
        handle.remove()


def _gather_rows(
    local: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """all_gather of [..., H_r, W] with per-rank H_r, by padding to max(H_r)."""
    longest = max(counts)
    if local.shape[-2] < longest:
        pad = local.new_zeros(*local.shape[:-2], longest - local.shape[-2], local.shape[-1])
        local = torch.cat([local, pad], dim=-2)
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in counts]
    dist.all_gather(parts, local, group=group)
    return torch.cat([p[..., :c, :] for p, c in zip(parts, counts, strict=True)], dim=-2)


def spatial_decode(
    vae: Any,
    z: torch.Tensor,
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    plan: SpatialPlan | None = None,
) -> torch.Tensor:
    """Decode latents ``z`` [B, C, T, h, w] with one row slab per rank; all ranks get all frames.

    Raises:
        ValueError: the decoder is not local in space after its middle block, or there are fewer
            latent rows than ranks.
    """
    plan = spatial_plan(vae) if plan is None else plan
    if plan is None:
        raise ValueError(
            f"{type(vae.decoder).__name__} has non-local modules after its middle block: "
            "spatial decode would not be exact; use the temporal mode"
        )
    exchange = HaloExchange(group)
    rows = z.shape[-2]
    if rows < exchange.world:
        raise ValueError(
            f"{rows} latent rows for {exchange.world} ranks: spatial decode needs at least one "
            "row per rank"
        )
    slabs = plan_rows(rows, exchange.world)
    local = decode_rows(vae, z, plan, exchange, slabs, decode_fn)
    factor = local.shape[-2] // (slabs[exchange.rank][1] - slabs[exchange.rank][0])
    return _gather_rows(local, [(b - a) * factor for a, b in slabs], group)
