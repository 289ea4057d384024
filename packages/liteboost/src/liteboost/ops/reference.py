"""The dense-mask reference block-sparse kernel: SDPA with the block list expanded to tokens.

Slow and memory-hungry (a full [B, N, Sq, Sk] mask) but obviously right; the tests compare every
other kernel with it. Registered as the ``reference`` sparse kernel, never chosen unasked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from liteboost.ops.blocks import BlockSize, block_index_to_dense, block_shape


def reference_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense SDPA with the block mask expanded to tokens; [B, N, S, D] in and out. Tests only."""
    (bq, bk), sq, sk = block_shape(block_size), q.shape[-2], k.shape[-2]
    dense = block_index_to_dense(block_index, math.ceil(sk / bk))
    token_mask = dense.repeat_interleave(bq, -2)[..., :sq, :]
    token_mask = token_mask.repeat_interleave(bk, -1)[..., :sk]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask, scale=scale)
