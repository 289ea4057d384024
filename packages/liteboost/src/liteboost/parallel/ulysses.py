"""Ulysses sequence parallelism: all-to-all between a sequence shard and a head shard.

Each rank holds ``shard_len`` tokens of every head; before self-attention one all-to-all gives it
every token of ``heads / degree`` heads, after it a second all-to-all returns to the sequence
shard. Sequences not divisible by the degree are padded at the end; the pad tokens are cut off
before attention, so they are never attended (masked by exclusion, exact). Head counts not
divisible by the degree are padded with zero heads, whose outputs are dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def working_degrees(heads: int, world_size: int) -> list[int]:
    """Ulysses degrees that split ``heads`` evenly and divide ``world_size``."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0]


class TokenShards:
    """Equal token shards over a group: the split every sequence-parallel layout shares.

    Subclasses set ``group``, ``rank`` (in the group) and ``degree`` (its size).
    """

    group: dist.ProcessGroup | None
    rank: int
    degree: int

    def shard(self, x: torch.Tensor, shard_len: int, dim: int = 1) -> torch.Tensor:
        """This rank's ``shard_len`` tokens of ``x`` along ``dim`` (zero-padded at the end)."""
        total = shard_len * self.degree
        if x.shape[dim] < total:
            pad_shape = list(x.shape)
            pad_shape[dim] = total - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        return x.narrow(dim, self.rank * shard_len, shard_len)

    def gather(self, x: torch.Tensor, seq_len: int, dim: int = 1) -> torch.Tensor:
        """Concatenate every rank's equal-size shard along ``dim`` and drop the padding."""
        x = x.contiguous()
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(self.degree)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, seq_len)


class UlyssesExchange(TokenShards):
    """The two all-to-alls of one Ulysses group, for [B, S, N, D] (BSND) activations.

    Args:
        group: the process group of the sequence-parallel ranks (None = default group).
        heads: attention heads of the model.
        pad_heads: allow ``heads % degree != 0`` by padding zero heads; when False such a degree
            raises an error naming the degrees that divide the heads.
    """

    def __init__(self, group: dist.ProcessGroup | None, heads: int, pad_heads: bool = True) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if heads % self.degree and not pad_heads:
            raise ValueError(
                f"ulysses_degree={self.degree} does not divide the {heads} attention heads; "
                f"degrees that work: {working_degrees(heads, dist.get_world_size())} "
                "(or allow head padding)"
            )
        self.heads = heads
        self.padded_heads = -(-heads // self.degree) * self.degree

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        # Collectives fill buffers in contiguous order: never hand them strided tensors
        # (empty_like would copy a permuted input's strides).
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def scatter_heads(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[B, L, N, D] sequence shard -> [B, seq_len, N_pad / degree, D] head shard."""
        b, shard_len, heads, d = x.shape
        if heads < self.padded_heads:
            x = torch.cat([x, x.new_zeros(b, shard_len, self.padded_heads - heads, d)], dim=2)
        per_rank = self.padded_heads // self.degree
        # [B, L, P, h, D] -> [P, B, L, h, D]: chunk p goes to rank p (its heads).
        send = x.view(b, shard_len, self.degree, per_rank, d).permute(2, 0, 1, 3, 4)
        recv = self._all_to_all(send)
        # recv[p] holds rank p's tokens: [P, B, L, h, D] -> [B, P * L, h, D].
        full = recv.permute(1, 0, 2, 3, 4).reshape(b, self.degree * shard_len, per_rank, d)
        return full[:, :seq_len]

    def gather_heads(self, x: torch.Tensor, shard_len: int) -> torch.Tensor:
        """[B, seq_len, N_pad / degree, D] -> [B, L, N, D] (inverse of :meth:`scatter_heads`)."""
        b, seq_len, per_rank, d = x.shape
        total = shard_len * self.degree
        if seq_len < total:
            x = torch.cat([x, x.new_zeros(b, total - seq_len, per_rank, d)], dim=1)
        send = x.view(b, self.degree, shard_len, per_rank, d).permute(1, 0, 2, 3, 4)
        recv = self._all_to_all(send)
        # recv[p] holds head group p of my tokens: [P, B, L, h, D] -> [B, L, P * h, D].
        out = recv.permute(1, 2, 0, 3, 4).reshape(b, shard_len, self.padded_heads, d)
        return out[:, :, : self.heads]
