"""Token order for block-sparse video attention: tokens of one spatial-temporal tile sit together.

Wan flattens latent tokens frame by frame, row by row, so a 128-token block of the raw order is
a thin horizontal strip. Reordering into (frames x rows x cols) tiles makes each block a compact
3-D neighbourhood whose pooled query/key summarise it well. Frame 0 (the image frame of Wan I2V,
and the attention sink of T2V) is tiled on its own so that its blocks can always be kept.
Grids that are not multiples of the tile (Wan at 480p: 30 x 52 latent tokens per frame) get
smaller tiles at the right and bottom edges; that remainder path is the normal path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileLayout:
    """The permutation of ``frames * height * width`` video tokens into tile order.

    Attributes:
        order: int64 [L]; ``tiled = tokens[order]``.
        inverse: int64 [L]; ``tokens = tiled[inverse]``.
        first_frame_tokens: how many tiled tokens (a prefix) belong to frame 0.
    """

    order: torch.Tensor
    inverse: torch.Tensor
    first_frame_tokens: int


def default_tile(block_size: int) -> tuple[int, int, int]:
    """A (frames, rows, cols) tile holding about ``block_size`` tokens: 2 x 8 x 8 for 128."""
    side = max(1, math.isqrt(max(1, block_size // 2)))
    frames = max(1, block_size // (side * side))
    return frames, side, side


@functools.lru_cache(maxsize=64)
def _tile_layout_cpu(
    grid: tuple[int, int, int], tile: tuple[int, int, int], first_frame_alone: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    frames, height, width = grid
    tf, th, tw = tile
    f = torch.arange(frames).view(-1, 1, 1).expand(grid)
    h = torch.arange(height).view(1, -1, 1).expand(grid)
    w = torch.arange(width).view(1, 1, -1).expand(grid)
    if first_frame_alone:
        f_tile = torch.where(f == 0, 0, 1 + (f - 1).clamp(min=0) // tf)
    else:
        f_tile = f // tf
    h_tiles, w_tiles = math.ceil(height / th), math.ceil(width / tw)
    tile_id = (f_tile * h_tiles + h // th) * w_tiles + w // tw
    # Inside a tile keep raster order; a stable sort by tile id does exactly that.
    order = torch.argsort(tile_id.flatten(), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    first = height * width if first_frame_alone else 0
    return order, inverse, first


_DEVICE_CACHE: dict[tuple, TileLayout] = {}


def tile_layout(
    grid: tuple[int, int, int],
    tile: tuple[int, int, int],
    device: torch.device | str = "cpu",
    first_frame_alone: bool = True,
) -> TileLayout:
    """The cached :class:`TileLayout` for a latent ``grid`` (frames, height, width).

    Raises:
        ValueError: a grid or tile entry is < 1.
    """
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"latent_shape={grid} must be three positive ints (frames, height, width)")
    if len(tile) != 3 or min(tile) < 1:
        raise ValueError(f"tile={tile} must be three positive ints (frames, rows, cols)")
    device = torch.device(device)
    key = (tuple(grid), tuple(tile), str(device), first_frame_alone)
    layout = _DEVICE_CACHE.get(key)
    if layout is None:
        order, inverse, first = _tile_layout_cpu(tuple(grid), tuple(tile), first_frame_alone)
        layout = TileLayout(order.to(device), inverse.to(device), first)
        _DEVICE_CACHE[key] = layout
    return layout


def reorder(x: torch.Tensor, layout: TileLayout, seq_dim: int, offset: int = 0) -> torch.Tensor:
    """Put the video tokens ``x[offset : offset + L]`` along ``seq_dim`` into tile order."""
    index = layout.order + offset if offset else layout.order
    return _permute(x, index, seq_dim, offset)


def restore(x: torch.Tensor, layout: TileLayout, seq_dim: int, offset: int = 0) -> torch.Tensor:
    """Inverse of :func:`reorder`."""
    index = layout.inverse + offset if offset else layout.inverse
    return _permute(x, index, seq_dim, offset)


def _permute(x: torch.Tensor, index: torch.Tensor, seq_dim: int, offset: int) -> torch.Tensor:
    length = index.numel()
    if offset == 0 and length == x.shape[seq_dim]:
        return x.index_select(seq_dim, index)
    pieces = [
        x.narrow(seq_dim, 0, offset),
        x.index_select(seq_dim, index),
        x.narrow(seq_dim, offset + length, x.shape[seq_dim] - offset - length),
    ]
    return torch.cat(pieces, dim=seq_dim)
