"""Wan's 3-D rotary position embedding with cached fp32 tables.

diffusers' ``WanRotaryPosEmbed`` rebuilds the per-token cos/sin tables (float64 on CPU and CUDA)
on every forward, and its processor rotates with strided slices in the tables' float64. Here the
tables are built once per (head dim, theta, latent grid, table dtype, device), stored as one
complex64 tensor, and the rotation is a single complex multiply in fp32: the same arithmetic
(``(x1 + i x2) (cos + i sin)``), within 1e-6 of diffusers' result.
"""

from __future__ import annotations

import threading

import torch

_CACHE: dict[tuple, RopeTables] = {}
_LOCK = threading.Lock()


class RopeTables(tuple):
    """``(cos, sin)`` in diffusers' layout [1, S, 1, D], plus ``freqs``: complex64 [S, 1, D/2].

    Being a tuple, it can stand in for the ``rotary_emb`` diffusers passes to its processors;
    liteboost's processor uses ``freqs`` instead.
    """

    freqs: torch.Tensor

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor, freqs: torch.Tensor) -> RopeTables:
        tables = super().__new__(cls, (cos, sin))
        tables.freqs = freqs
        return tables

    def __getnewargs__(self):
        return (self[0], self[1], self.freqs)

    def narrow(self, start: int, length: int) -> RopeTables:
        """The tables of tokens ``start .. start + length`` (a sequence shard)."""
        return RopeTables(
            self[0].narrow(1, start, length),
            self[1].narrow(1, start, length),
            self.freqs.narrow(0, start, length),
        )


def _axis_angles(dim: int, positions: int, theta: float) -> torch.Tensor:
    """Angles [positions, dim / 2] in float64, as ``get_1d_rotary_pos_embed`` computes them."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim
    inv_freq = 1.0 / theta**exponents
    return torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of the frame, height and width rotations (Wan: 2 * (D // 6) for h and w)."""
    h_dim = w_dim = 2 * (head_dim // 6)
    return head_dim - h_dim - w_dim, h_dim, w_dim


def build_rope_tables(
    head_dim: int,
    grid: tuple[int, int, int],
    *,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> RopeTables:
    """Build (uncached) the tables for a post-patch token ``grid`` (frames, height, width).

    Angles are computed in float64 (as diffusers does) and rounded once to ``dtype``.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embedding")
    frames, height, width = grid
    t_dim, h_dim, w_dim = axis_dims(head_dim)
    angles = torch.cat(
        [
            _axis_angles(t_dim, frames, theta)
            .view(frames, 1, 1, -1)
            .expand(frames, height, width, -1),
            _axis_angles(h_dim, height, theta)
            .view(1, height, 1, -1)
            .expand(frames, height, width, -1),
            _axis_angles(w_dim, width, theta)
            .view(1, 1, width, -1)
            .expand(frames, height, width, -1),
        ],
        dim=-1,
    ).reshape(frames * height * width, head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    freqs = torch.complex(cos.to(dtype), sin.to(dtype)).unsqueeze(1).to(device)
    seq = frames * height * width
    cos_full = cos.repeat_interleave(2, dim=-1).view(1, seq, 1, head_dim).to(device, dtype)
    sin_full = sin.repeat_interleave(2, dim=-1).view(1, seq, 1, head_dim).to(device, dtype)
    return RopeTables(cos_full, sin_full, freqs)


def rope_tables(
    head_dim: int,
    grid: tuple[int, int, int],
    *,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> RopeTables:
    """Cached :func:`build_rope_tables`, keyed by head dim, theta, grid, dtype and device."""
    device = torch.device(device)
    key = (head_dim, float(theta), tuple(grid), dtype, str(device))
    tables = _CACHE.get(key)
    if tables is None:
        with _LOCK:
            tables = _CACHE.get(key)
            if tables is None:
                tables = build_rope_tables(head_dim, grid, theta=theta, dtype=dtype, device=device)
                _CACHE[key] = tables
    return tables


def clear_rope_cache() -> None:
    """Drop every cached table (e.g. after moving a model to another device)."""
    with _LOCK:
        _CACHE.clear()


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x`` by ``freqs``; computes in fp32.

    Args:
        x: [B, S, N, D] (diffusers' Wan layout), any float dtype.
        freqs: complex64 [S, 1, D/2] from :func:`rope_tables`.

    Returns:
        The rotated tensor, dtype of ``x``.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * freqs)
    return rotated.flatten(-2).type_as(x)
