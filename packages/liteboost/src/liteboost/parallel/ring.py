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

Block-sparse ring attention (:meth:`RingAttention.sparse`): the sequence is cut in the tile
order of the sparse kernels, whole blocks per rank. Every rank sums its own blocks, the block
sums (one vector per block and head) are all-gathered, and every rank chooses the kept key blocks
from the same means as the single process would (bit for bit: a block's sum does not depend on
the rest of the sequence). Each K/V chunk is then attended only by the query blocks that keep
one of its key blocks, and only with those blocks; a chunk that no local query block keeps is
passed on without compute.

The per-chunk kernels (dense and block-sparse, each returning the log-sum-exp the merge needs)
are plug-ins of ``liteboost.parallel.ring_kernels``, chosen per device and logged there.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from liteboost.ops import tiling
from liteboost.ops.blocks import BlockSize, block_shape
from liteboost.ops.sparse_attention import block_means, block_sums, select_pooled_blocks
from liteboost.parallel.ring_kernels import ChunkCall, select_dense_kernel, select_sparse_kernel


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention of [B, N, S, D] (BNSD) inputs and its log-sum-exp [B, N, S].

    Runs the dense chunk kernel that ``liteboost.parallel.ring_kernels.RING_DENSE_KERNELS``
    chooses for the inputs' device and dtype (ATen's fused flash kernel on CPU, the
    memory-efficient kernel on CUDA, an explicit fp32 softmax elsewhere). The output is in
    ``q``'s dtype, the log-sum-exp fp32.
    """
    return select_dense_kernel(ChunkCall.of(q)).impl(q, k, v, scale)


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
    # Rows that attended nothing on both sides (lse -inf, sparse chunks) stay zero, not NaN.
    safe = merged.masked_fill(merged == -math.inf, 0.0)
    old_weight = torch.exp(lse - safe).unsqueeze(-1)
    out = out * old_weight + part * torch.exp(part_lse - safe).unsqueeze(-1)
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
        assert ring is not None, "torch.distributed is not initialised"
        self._next = dist.get_global_rank(ring, (self.rank + 1) % self.degree)
        self._prev = dist.get_global_rank(ring, (self.rank - 1) % self.degree)
        self.attended_blocks = 0  # (query block, key block) pairs the last sparse() computed

    def _pass(self, kv: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work | None]]:
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
        attend = select_dense_kernel(ChunkCall.of(q)).impl
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
                part, part_lse = attend(qt, keys, values, scale)
                out, lse = merge_partials(out, lse, part, part_lse)
            if step + 1 < self.degree:
                for op in ops:
                    if op is not None:
                        op.wait()
                kv = incoming
        if out is None:  # unreachable: chunk 0 always holds real tokens
            raise RuntimeError(f"seq_len={seq_len}: no keys to attend")
        return out.transpose(1, 2).to(q.dtype)

    def sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        latent_shape: tuple[int, int, int],
        sparsity: float,
        block_size: BlockSize = 128,
        text_len: int = 0,
        first_frame_sink: bool = True,
        tile: tuple[int, int, int] | None = None,
        scale: float | None = None,
        kernel: str | None = None,
    ) -> torch.Tensor:
        """Block-sparse attention (the single process's kept blocks) over the ring.

        Equal to :func:`liteboost.ops.sparse_attention` of the whole sequence, in tile order,
        up to float rounding: the same key blocks are kept, chosen from the same block means.

        Args:
            q: [B, N, L, D] (BNSD), this rank's chunk of the sequence in the tile order of
                ``tiling.tile_layout(latent_shape, tile, ...)`` (see :func:`tiled_chunk`): rank
                ``r`` holds tiled tokens ``[r * L, (r + 1) * L)``, zero padded at the end; L a
                multiple of both block sizes and the same on every rank.
            k: [B, N, L, D], the keys of the same chunk.
            v: [B, N, L, D], the values of the same chunk.
            latent_shape: the token grid (frames, height, width) after patching.
            sparsity: share of key blocks skipped per query block, in [0, 1).
            block_size: tokens per block, an int or a (query, key) pair.
            text_len: text tokens after the video tokens.
            first_frame_sink: as in :func:`liteboost.ops.sparse_attention`.
            tile: as in :func:`liteboost.ops.sparse_attention`.
            scale: softmax scale (default 1 / sqrt(D)).
            kernel: force a per-chunk kernel of
                ``liteboost.parallel.ring_kernels.RING_SPARSE_KERNELS`` by name: "cpu" (the
                fused C++ kernel; it falls back to block gather itself where it cannot be built
                or autograd records), "gather" (block gather) or a registered plug-in; None lets
                the registry choose ("cpu" for CPU tensors, "gather" elsewhere). The fused
                kernel measured faster than block gather per chunk
                (``benchmarks/ring_sparse.py``).

        Returns:
            [B, N, L, D] in ``q``'s dtype, this rank's chunk in tile order (pad rows: zeros or
            garbage, for the caller to drop).

        After the call, ``attended_blocks`` holds the (query block, key block) pairs this rank
        computed: exactly the kept pairs of its query blocks.

        Raises:
            ValueError: a chunk that is not whole blocks, or a sequence that does not fit the
                chunks; ``npu_core.plugins.PluginError`` (a ValueError) for an unknown
                ``kernel`` or one that does not take the chunks' device and dtype.
        """
        attend = select_sparse_kernel(ChunkCall.of(q), kernel).impl
        q_block, kv_block = block_shape(block_size)
        chunk = q.shape[2]
        if chunk % q_block or chunk % kv_block:
            raise ValueError(
                f"chunk of {chunk} tokens per rank: must be a multiple of the query block "
                f"({q_block}) and the key block ({kv_block}); see tiled_chunk()"
            )
        seq_len = math.prod(latent_shape) + text_len
        if not 0 < seq_len <= chunk * self.degree:
            raise ValueError(
                f"latent_shape={tuple(latent_shape)} + text_len={text_len} = {seq_len} tokens "
                f"do not fit {self.degree} chunks of {chunk}"
            )
        layout = tiling.tile_layout(
            latent_shape, tile or tiling.default_tile(kv_block), q.device, first_frame_sink
        )
        means = []
        for x, block in ((q, q_block), (k, kv_block)):
            sums = block_sums(x, block)
            parts = [torch.empty_like(sums) for _ in range(self.degree)]
            dist.all_gather(parts, sums.contiguous(), group=self.group)
            total = torch.cat(parts, dim=2)[:, :, : math.ceil(seq_len / block)]
            means.append(block_means(total, seq_len, block))
        index, _ = select_pooled_blocks(
            means[0],
            means[1],
            key_tokens=seq_len,
            video_len=math.prod(latent_shape),
            first_frame_tokens=layout.first_frame_tokens,
            sparsity=sparsity,
            block_size=(q_block, kv_block),
        )
        rows = chunk // q_block
        index = index[:, :, self.rank * rows : (self.rank + 1) * rows]
        if index.shape[2] < rows:  # pad query blocks at the end keep nothing
            pad = index.new_full((*index.shape[:2], rows - index.shape[2], index.shape[3]), -1)
            index = torch.cat([index, pad], dim=2)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        self.attended_blocks = 0
        key_blocks = chunk // kv_block
        for step in range(self.degree):
            if step + 1 < self.degree:
                incoming, ops = self._pass(kv)
            source = (self.rank - step) % self.degree
            valid = min(max(seq_len - source * chunk, 0), chunk)
            local = index - source * key_blocks
            local = torch.where((local >= 0) & (local < key_blocks), local, -1)
            kept = int((local >= 0).sum())
            if valid > 0 and kept:
                part, part_lse = attend(
                    q, kv[0, :, :, :valid], kv[1, :, :, :valid], local, (q_block, kv_block), scale
                )
                out, lse = merge_partials(out, lse, part, part_lse)
                self.attended_blocks += kept
            if step + 1 < self.degree:
                for op in ops:
                    if op is not None:
                        op.wait()
                kv = incoming
        if out is None:
            return torch.zeros_like(q)
        return out.to(q.dtype)


def tiled_chunk(
    x: torch.Tensor,
    latent_shape: tuple[int, int, int],
    degree: int,
    rank: int,
    *,
    block_size: BlockSize = 128,
    first_frame_sink: bool = True,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``x`` [B, N, S, D] (raster order) for :meth:`RingAttention.sparse`.

    Reorders into the sparse kernels' tile order, pads the end to ``degree`` equal chunks of
    whole blocks and returns chunk ``rank``; ``tiling.restore`` of the concatenated outputs
    (cut to S) gives the raster order back.
    """
    q_block, kv_block = block_shape(block_size)
    unit = math.lcm(q_block, kv_block)
    layout = tiling.tile_layout(
        latent_shape, tile or tiling.default_tile(kv_block), x.device, first_frame_sink
    )
    tiled = tiling.reorder(x, layout, seq_dim=2)
    chunk = math.ceil(tiled.shape[2] / (degree * unit)) * unit
    tiled = torch.nn.functional.pad(tiled, (0, 0, 0, chunk * degree - tiled.shape[2]))
    return tiled[:, :, rank * chunk : (rank + 1) * chunk].contiguous()
