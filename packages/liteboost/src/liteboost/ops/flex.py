"""The FlexAttention block-sparse kernel: a ``BlockMask`` built from the kept-block list.

Compiled once per shape and cached (8-35 s on CPU); on CUDA it is a fused Triton kernel and the
chain's choice there. On CPU the fused and gather kernels measured faster, so there it runs only
when forced (``kernel="flex"``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from liteboost.ops.blocks import BlockSize, block_shape

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger(__name__)


# One compiled FlexAttention per (shape, dtype, device, block size): compiling costs 8-35 s on
# CPU, so a process pays it once per shape. torch.compile's own guard cache would also work, but
# an explicit table keeps several shapes from exhausting dynamo's per-function recompile limit.
_FLEX_CACHE: dict[tuple, Callable[..., torch.Tensor]] = {}
_FLEX_LOCK = threading.Lock()
_SKIP_MASK = {"SKIP_MASK_SCORE": True}


def _compiled_flex(key: tuple) -> Callable[..., torch.Tensor]:
    with _FLEX_LOCK:
        fn = _FLEX_CACHE.get(key)
        if fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            fn = torch.compile(flex_attention, dynamic=False)
            _FLEX_CACHE[key] = fn
            logger.debug("compiling FlexAttention for %s", key)
        return fn


def build_block_mask(
    block_index: torch.Tensor, block_size: BlockSize, seq_len: tuple[int, int]
) -> BlockMask:
    """FlexAttention ``BlockMask`` from a -1 padded key-block list [B, N, nq, K].

    Every listed block is passed as a *full* block (no per-token mask inside), so the kernel skips
    mask evaluation; only the sequence tail, which FlexAttention bounds by ``seq_lengths``, is
    partial.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = block_shape(block_size)
    num_kv_blocks = math.ceil(seq_len[1] / block_size[1])
    valid = block_index >= 0
    counts = valid.sum(-1, dtype=torch.int32)
    width = block_index.shape[-1]
    indices = torch.where(valid, block_index, 0).to(torch.int32)
    if width < num_kv_blocks:
        pad = indices.new_zeros((*indices.shape[:-1], num_kv_blocks - width))
        indices = torch.cat([indices, pad], dim=-1)
    empty = torch.zeros_like(counts)
    return BlockMask.from_kv_blocks(
        empty,
        torch.zeros_like(indices),
        counts,
        indices.contiguous(),
        BLOCK_SIZE=block_size,
        seq_lengths=seq_len,
        compute_q_blocks=False,
    )


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor:
    """FlexAttention kernel; [B, N, S, D] in and out. ``block_mask`` may be prebuilt."""
    block_size = block_shape(block_size)
    if block_mask is None:
        block_mask = build_block_mask(block_index, block_size, (q.shape[-2], k.shape[-2]))
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device.type, block_size)
    fn = _compiled_flex(key)
    # No score_mod or mask_mod: every kept block is attended whole, so the per-element mask
    # evaluation can be skipped (sequence tails are bounded by the kernel itself).
    return fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=_SKIP_MASK)
