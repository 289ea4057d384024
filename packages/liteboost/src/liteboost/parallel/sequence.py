"""Sequence parallelism over Ulysses x Ring ranks: one shard of the token sequence per rank.

The sequence-parallel ranks form a ``ring_degree x ulysses_degree`` grid (Ulysses innermost, as
xDiT lays it out: the all-to-alls want the fastest links). Rank ``r = ring * U + ulysses`` holds
tokens ``[r * L, (r + 1) * L)``. For self-attention the Ulysses all-to-all turns the ``U``
sequence shards of one ring position into one contiguous chunk of ``U * L`` tokens with
``heads / U`` heads; ring attention then runs over the ``ring_degree`` chunks; a second all-to-all
returns to the sequence shard. With ``ring_degree == 1`` this is plain Ulysses (and the chunk is
the whole sequence, so the block-sparse kernels can run on it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from liteboost.ops.blocks import BlockSize
from liteboost.parallel.ring import RingAttention
from liteboost.parallel.ulysses import TokenShards, UlyssesExchange


class SequenceParallel(TokenShards):
    """Shard / gather over all sequence-parallel ranks plus the self-attention exchange.

    Offers the interface of :class:`UlyssesExchange` (``shard``, ``gather``, ``scatter_heads``,
    ``gather_heads``, ``degree``, ``rank``) so the Ulysses-only path is unchanged, and
    :meth:`ring_attention` for layouts with a ring.

    Args:
        group: all sequence-parallel ranks (``ring_degree * ulysses_degree``), ranked
            ``ring * ulysses_degree + ulysses``.
        ulysses_group: this rank's Ulysses group (None when ``ulysses_degree == 1``).
        ring_group: this rank's ring group (None when ``ring_degree == 1``).
        heads: attention heads of the model.
        pad_heads: allow heads not divisible by the Ulysses degree (zero heads).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        ulysses_group: dist.ProcessGroup | None,
        ring_group: dist.ProcessGroup | None,
        heads: int,
        pad_heads: bool = True,
    ) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ulysses = (
            UlyssesExchange(ulysses_group, heads, pad_heads)
            if ulysses_group is not None and dist.get_world_size(ulysses_group) > 1
            else None
        )
        self.ring = (
            RingAttention(ring_group)
            if ring_group is not None and dist.get_world_size(ring_group) > 1
            else None
        )
        self.ulysses_degree = self.ulysses.degree if self.ulysses else 1
        self.ring_degree = self.ring.degree if self.ring else 1
        if self.ulysses_degree * self.ring_degree != self.degree:
            raise ValueError(
                f"sequence-parallel group of {self.degree} ranks is not ulysses_degree="
                f"{self.ulysses_degree} x ring_degree={self.ring_degree}"
            )

    def scatter_heads(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Ulysses only: [B, L, N, D] shard -> [B, seq_len, N / U, D] (whole sequence)."""
        if self.ring is not None:
            raise RuntimeError("with a ring, self-attention goes through ring_attention()")
        return self.ulysses.scatter_heads(x, seq_len) if self.ulysses else x[:, :seq_len]

    def gather_heads(self, x: torch.Tensor, shard_len: int) -> torch.Tensor:
        """Ulysses only: inverse of :meth:`scatter_heads`."""
        return self.ulysses.gather_heads(x, shard_len) if self.ulysses else x

    def ring_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_len: int,
        shard_len: int,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Dense self-attention of this rank's [B, shard_len, N, D] shard over the whole sequence.

        Ulysses all-to-all into the ring chunk (no padding cut: the chunk keeps its length),
        ring attention over the chunks with pad keys excluded, all-to-all back.
        """
        chunk_len = shard_len * self.ulysses_degree
        if self.ulysses is not None:
            q, k, v = (self.ulysses.scatter_heads(t, chunk_len) for t in (q, k, v))
        out = self.ring(q, k, v, seq_len, scale) if self.ring else _dense(q, k, v, seq_len, scale)
        if self.ulysses is not None:
            out = self.ulysses.gather_heads(out, shard_len)
        return out

    def sparse_ring_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        latent_shape: tuple[int, int, int],
        shard_len: int,
        sparsity: float,
        block_size: BlockSize,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Block-sparse self-attention of this rank's [B, shard_len, N, D] tile-order shard.

        The shards must be cut in the tile order of ``sparse_attention`` (default tile, frame 0
        alone) with ``ulysses_degree * shard_len`` a multiple of the blocks: Ulysses all-to-all
        into the ring chunk, :meth:`RingAttention.sparse` (the single process's kept blocks),
        all-to-all back.
        """
        if self.ring is None:
            raise RuntimeError("sparse_ring_attention needs a ring (ring_degree > 1)")
        chunk_len = shard_len * self.ulysses_degree
        if self.ulysses is not None:
            q, k, v = (self.ulysses.scatter_heads(t, chunk_len) for t in (q, k, v))
        out = self.ring.sparse(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            latent_shape=latent_shape,
            sparsity=sparsity,
            block_size=block_size,
            scale=scale,
        ).transpose(1, 2)
        if self.ulysses is not None:
            out = self.ulysses.gather_heads(out, shard_len)
        return out


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float | None
) -> torch.Tensor:
    # Only reached with ring_degree == 1, where callers use scatter_heads instead.
    k, v = k[:, :seq_len], v[:, :seq_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)
