"""Ring attention: K/V blocks travel around a ring of ranks, merged by log-sum-exp.

Each rank of a ring group holds one contiguous chunk of the sequence's queries, keys and values.
In ``degree`` steps every rank attends its queries to one K/V chunk (its own first) while the
next chunk is already in flight from its left neighbour (``isend``/``irecv``, no all-gather: a
rank never holds more than two K/V chunks). The partial outputs are merged with their
log-sum-exps (the online softmax of flash attention, one level up):

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is exact: softmax over the concatenated keys, up to reduction order. Pad tokens sit at the
end of the global sequence (the last chunks); their keys are cut off before attention, so they are
never attended, and their query rows are dropped by the caller.

Dense attention only: the block-sparse kernels choose key blocks from pooled queries and keys of
the whole sequence, which no rank holds here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention of [B, N, S, D] (BNSD) inputs and its log-sum-exp [B, N, S].

    CPU runs ATen's fused flash-attention kernel, which returns the log-sum-exp it already
    computes; CUDA the memory-efficient kernel; other devices an explicit fp32 softmax.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, scale=scale
        )
        return out, lse.float()
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, lse


def merge_partials(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    part: torch.Tensor,
    part_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result ([B, N, S, D], lse [B, N, S]) into the running one, in fp32."""
    part = part.float()
    if out is None or lse is None:
        return part, part_lse
    merged = torch.logaddexp(lse, part_lse)
    old_weight = torch.exp(lse - merged).unsqueeze(-1)
    out = out * old_weight + part * torch.exp(part_lse - merged).unsqueeze(-1)
    return out, merged


class RingAttention:
    """Dense attention over a sequence split into equal chunks across the ranks of ``group``.

    Args:
        group: the ring's process group; its rank ``r`` holds chunk ``r`` of the sequence.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ring = group if group is not None else dist.group.WORLD
        self._next = dist.get_global_rank(ring, (self.rank + 1) % self.degree)
        self._prev = dist.get_global_rank(ring, (self.rank - 1) % self.degree)

    def _pass(self, kv: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send ``kv`` to the next rank, start receiving the previous rank's chunk."""
        recv = torch.empty_like(kv)
        ops = [
            dist.isend(kv, self._next, group=self.group),
            dist.irecv(recv, self._prev, group=self.group),
        ]
        return recv, ops

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_len: int,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's query chunk over all ranks' K/V chunks.

        Args:
            q, k, v: this rank's chunk, [B, L, N, D] (BSND), the same L on every rank.
            seq_len: real tokens in the whole sequence (``degree * L`` minus end padding); keys
                at or past it are never attended.
            scale: softmax scale (default 1 / sqrt(D)).

        Returns:
            [B, L, N, D] in ``q``'s dtype.
        """
        chunk = q.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        qt = q.transpose(1, 2)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(self.degree):
            if step + 1 < self.degree:
                incoming, ops = self._pass(kv)
            source = (self.rank - step) % self.degree
            valid = min(max(seq_len - source * chunk, 0), chunk)
            if valid > 0:
                keys = kv[0, :, :valid].transpose(1, 2)
                values = kv[1, :, :valid].transpose(1, 2)
                part, part_lse = attention_with_lse(qt, keys, values, scale)
                out, lse = merge_partials(out, lse, part, part_lse)
            if step + 1 < self.degree:
                for op in ops:
                    op.wait()
                kv = incoming
        if out is None:  # unreachable: chunk 0 always holds real tokens
            raise RuntimeError(f"seq_len={seq_len}: no keys to attend")
        return out.transpose(1, 2).to(q.dtype)
