"""Wan's 3-D rotary position embedding with cached fp32 tables and real fp32 arithmetic.

diffusers' ``WanRotaryPosEmbed`` rebuilds the per-token cos/sin tables on every forward, and its
processor rotates with strided slices into a fresh tensor. Here the tables are built once per
(head dim, theta, latent grid, table dtype, device) and kept as one cos and one sin value per
channel pair, and the rotation is real arithmetic in fp32 (``x1 cos - x2 sin``,
``x1 sin + x2 cos``), within 1e-6 of diffusers' result. No complex tensors: complex multiplies
are weak on NPUs and Inductor does not lower them, so a complex rotation would leave
``torch.compile`` graphs with eager fallbacks.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_CACHE: dict[tuple, RopeTables] = {}
_LOCK = threading.Lock()


class RopeTables(tuple):
    """``(cos, sin)`` in diffusers' layout [1, S, 1, D], plus one value per channel pair.

    Being a tuple, it can stand in for the ``rotary_emb`` diffusers passes to its processors;
    liteboost's processor uses ``pair_cos`` / ``pair_sin`` ([S, 1, D/2], contiguous) instead.
    """

    pair_cos: torch.Tensor
    pair_sin: torch.Tensor

    def __new__(
        cls, cos: torch.Tensor, sin: torch.Tensor, pair_cos: torch.Tensor, pair_sin: torch.Tensor
    ) -> RopeTables:
        tables = super().__new__(cls, (cos, sin))
        tables.pair_cos, tables.pair_sin = pair_cos, pair_sin
        return tables

    def __getnewargs__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self[0], self[1], self.pair_cos, self.pair_sin)

    def narrow(self, start: int, length: int) -> RopeTables:
        """The tables of tokens ``start .. start + length`` (a sequence shard)."""
        return RopeTables(
            self[0].narrow(1, start, length),
            self[1].narrow(1, start, length),
            self.pair_cos.narrow(0, start, length),
            self.pair_sin.narrow(0, start, length),
        )

    def padded(self, total: int) -> RopeTables:
        """The tables extended with zeros to ``total`` tokens (padded Ulysses shards)."""
        extra = total - self[0].shape[1]
        if extra <= 0:
            return self

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        return RopeTables(
            pad(self[0], 1), pad(self[1], 1), pad(self.pair_cos, 0), pad(self.pair_sin, 0)
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
    seq = frames * height * width
    cos_full = cos.repeat_interleave(2, dim=-1).view(1, seq, 1, head_dim).to(device, dtype)
    sin_full = sin.repeat_interleave(2, dim=-1).view(1, seq, 1, head_dim).to(device, dtype)
    pair_cos = cos.unsqueeze(1).to(device, dtype).contiguous()
    pair_sin = sin.unsqueeze(1).to(device, dtype).contiguous()
    return RopeTables(cos_full, sin_full, pair_cos, pair_sin)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(x1, x2)`` of ``x`` by the tables; computes in fp32.

    Args:
        x: [B, S, N, D] (diffusers' Wan layout), any float dtype.
        cos: [S, 1, D/2] (``RopeTables.pair_cos``), fp32.
        sin: [S, 1, D/2] (``RopeTables.pair_sin``), fp32.

    Returns:
        ``(x1 cos - x2 sin, x1 sin + x2 cos)`` interleaved again, dtype of ``x``.
    """
    if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
        # Inductor fuses this into one loop; the functional form keeps the graph simple. Under
        # autograd it is the differentiable form (the in-place one below writes through out=).
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.flatten(-2).type_as(x)
    kernel = _cpu_kernel(x, cos, sin)
    if kernel is not None:
        # One pass in C++ (fp32 arithmetic, one rounding to x's dtype): eager torch needs several
        # passes and, for bf16, a conversion, which kept it at 1.3-1.5x diffusers in bf16.
        return kernel.rope_rotate(x, cos, sin)
    # Eager elsewhere (no compiler, other devices): write both halves of an fp32
    # output in place, four passes over half-size views and no temporaries; bf16/fp16 inputs
    # are promoted inside each op instead of copied first (on CPU the stacked form measured no
    # faster than diffusers', this about 2-3x in fp32; benchmarks/rope.py).
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    halves = out.unflatten(-1, (-1, 2))
    first, second = halves[..., 0], halves[..., 1]
    torch.mul(x1, cos, out=first)
    first.addcmul_(x2, sin, value=-1.0)
    torch.mul(x1, sin, out=second)
    second.addcmul_(x2, cos)
    return out.type_as(x)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """liteboost's C++ CPU extension when it can rotate ``x`` (inference on CPU, [B, S, N, D],
    per-token fp32 tables [S, 1, D/2]), else None (the torch form runs).

    The rotation lives in the same extension as the fused block-sparse kernel, so one build per
    machine serves both (about a minute, on first use; without a compiler the torch form runs).
    """
    if (
        x.device.type != "cpu"
        or x.dim() != 4
        or x.dtype not in _KERNEL_DTYPES
        or (x.requires_grad and torch.is_grad_enabled())
    ):
        return None
    table_shape = (x.shape[1], 1, x.shape[3] // 2)
    for t in (cos, sin):
        if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != table_shape:
            return None
    from liteboost.ops.cpu_extension import load_cpu_kernel

    return load_cpu_kernel()
