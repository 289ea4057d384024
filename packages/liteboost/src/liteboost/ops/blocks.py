"""Block geometry and input checks shared by the sparse-attention kernels and the selection."""

from __future__ import annotations

import torch

BlockSize = int | tuple[int, int]


def block_shape(block_size: BlockSize) -> tuple[int, int]:
    """(query block, key block) tokens from ``block_size``: an int for square blocks, or a pair.

    Raises:
        ValueError: not a positive int or a pair of them.
    """
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    if not (
        isinstance(pair, tuple | list)
        and len(pair) == 2
        and all(isinstance(x, int) and x >= 1 for x in pair)
    ):
        raise ValueError(
            f"block_size={block_size!r} must be a positive int or a (query, key) pair of them"
        )
    return tuple(pair)


def block_index_to_dense(block_index: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Boolean block mask [B, N, nq, nk] from a -1 padded index list [B, N, nq, K]."""
    valid = block_index >= 0
    dense = torch.zeros(
        (*block_index.shape[:-1], num_kv_blocks + 1), dtype=torch.bool, device=block_index.device
    )
    # Padding (-1) is routed to an extra column that is dropped afterwards.
    target = torch.where(valid, block_index, num_kv_blocks).long()
    dense.scatter_(-1, target, True)
    return dense[..., :num_kv_blocks]


def check_same_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError naming the shapes when BNSD q, k, v differ in batch or head count."""
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k, v must share batch and head counts; got {tuple(q.shape[:2])}, "
            f"{tuple(k.shape[:2])}, {tuple(v.shape[:2])}"
        )
