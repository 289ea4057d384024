"""Block-gather kernel for block-sparse attention: pack each row's kept key blocks, run SDPA.

Why this exists: on CPU, Inductor's FlexAttention kernel spends about three times as long per
attended block as torch's own fused SDPA kernel, so at 80% sparsity it barely beats dense SDPA.
Here every query block becomes one row of a batched SDPA call whose keys and values are its kept
blocks copied side by side. The copy is one pass over the kept K/V bytes, done a chunk of rows at
a time into reused buffers, so SDPA reads the packed blocks while they are still in cache.

Key blocks that *every* query row keeps (first-frame sinks, text blocks) are not packed per row:
on CPU they are attended once by the whole query sequence, where SDPA runs its large-tile path,
and the two partial results are merged through their log-sum-exp. That merge is for inference;
when autograd records, shared blocks are packed like the rest and every step is differentiable.
Rows that keep different numbers of blocks are grouped by count; a partial last key block is
masked where it is gathered.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.nn.functional as F

from liteboost.ops.blocks import BlockSize, block_index_to_dense, block_shape, check_same_heads

# Packed K+V bytes per chunk: big enough that each SDPA call has work for every thread, small
# enough to stay in a server CPU's last-level cache (measured flat between 4 and 64 MiB).
CHUNK_BYTES = 16 << 20


def _as_block_rows(x: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[B, N, S, D] -> [B * N * num_blocks, block_size, D], zero-padding the sequence tail."""
    b, n, s, d = x.shape
    pad = num_blocks * block_size - s
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(b * n * num_blocks, block_size, d)


def shared_blocks(block_index: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Bool [nk]: key blocks listed in every query row of every batch element and head."""
    rows = block_index_to_dense(block_index, num_kv_blocks).flatten(0, 2)
    return rows.all(0)


def without_blocks(block_index: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``block_index`` with the key blocks marked in ``drop`` (bool [nk]) replaced by -1."""
    keep = (block_index >= 0) & ~drop[block_index.clamp(min=0).long()]
    return torch.where(keep, block_index, -1)


def _global_block_ids(block_index: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Key-block ids [B*N*nq, K] into the flattened (batch, head, block) rows; -1 padding last."""
    b, n, nq, width = block_index.shape
    ids = block_index.reshape(b * n, nq, width).long()
    # Sorting descending moves every -1 behind the valid ids: softmax does not care about order.
    ids = ids.sort(dim=-1, descending=True).values
    offset = torch.arange(b * n, device=ids.device).view(-1, 1, 1) * num_kv_blocks
    return torch.where(ids >= 0, ids + offset, -1).reshape(b * n * nq, width)


def _tail_bias(
    ids: torch.Tensor, num_kv_blocks: int, kv_block: int, tail_pad: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """Additive mask [1, rows, 1, count * kv_block]: -inf on the padded keys of the last block.

    ``ids`` [rows, count] lists each row's packed blocks. None when no row holds the (partial)
    last key block.
    """
    is_last = (ids % num_kv_blocks) == num_kv_blocks - 1
    if not tail_pad or not bool(is_last.any()):
        return None
    padded = torch.arange(kv_block, device=ids.device) >= kv_block - tail_pad
    hidden = (is_last.unsqueeze(-1) & padded).reshape(1, ids.shape[0], 1, -1)
    return torch.zeros(hidden.shape, dtype=dtype, device=ids.device).masked_fill_(hidden, -math.inf)


@overload
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float | None,
    with_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float | None,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float | None,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA on BNSD tensors; with the log-sum-exp [B, N, S] (fp32) if asked.

    Only CPU exposes the LSE of its fused kernel (``_scaled_dot_product_flash_attention_for_cpu``),
    which is why the shared-block split is CPU-only; elsewhere the LSE comes from an explicit
    fp32 softmax (ring attention's sparse chunks only).
    """
    if with_lse and q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias, scale=scale
        )
    if with_lse:  # an explicit fp32 softmax, for block_sparse_attention_with_lse off the CPU
        scores = q.float() @ k.float().transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if bias is not None:
            scores = scores + bias.float()
        lse = torch.logsumexp(scores, dim=-1)
        return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), lse
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale), None


def _pack(block_rows: torch.Tensor, ids: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """Rows ``ids`` of ``block_rows`` side by side, into ``buffer`` when one is given."""
    if buffer is None:
        return block_rows.index_select(0, ids)
    return torch.index_select(block_rows, 0, ids, out=buffer[: ids.numel()])


def _packed_attention(
    q_rows: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    ids: torch.Tensor,
    kv_layout: tuple[int, int, int],
    dv: int,
    scale: float | None,
    chunk_bytes: int,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query block row attends its packed key blocks ``ids`` [rows, K] (-1 padded last).

    ``kv_layout`` is (key blocks per (batch, head), tokens per key block, pad tokens of the
    last key block). Returns out [rows, q_block, dv] (zeros where a row keeps nothing) and, when
    ``with_lse``, the fp32 log-sum-exp [rows, q_block] (-inf there).
    """
    nk, kv_block, tail_pad = kv_layout
    d = q_rows.shape[-1]
    counts = (ids >= 0).sum(-1)
    out = q_rows.new_zeros(q_rows.shape[0], q_rows.shape[1], dv)
    lse = torch.full(out.shape[:2], -math.inf, device=q_rows.device) if with_lse else None
    per_block = kv_block * (d + dv) * k_rows.element_size()  # packed K+V bytes
    threads = torch.get_num_threads()
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_rows, k_rows, v_rows))
    for count in counts.unique().tolist():
        if count == 0:
            continue
        rows = (counts == count).nonzero().squeeze(1)
        step = max(2 * threads, chunk_bytes // (count * per_block), 1)
        # Reused packing buffers save a page-faulting allocation per chunk (~10%); autograd
        # cannot record writes into them, so training allocates per chunk.
        k_buf = v_buf = None
        if not needs_grad:
            k_buf = k_rows.new_empty(min(step, rows.numel()) * count, k_rows.shape[1])
            v_buf = v_rows.new_empty(k_buf.shape[0], v_rows.shape[1])
        for start in range(0, rows.numel(), step):
            chunk = rows[start : start + step]
            chunk_ids = ids[chunk, :count]
            flat = chunk_ids.reshape(-1)
            keys, values = _pack(k_rows, flat, k_buf), _pack(v_rows, flat, v_buf)
            rows_out, rows_lse = _attend(
                q_rows.index_select(0, chunk).unsqueeze(0),
                keys.view(1, chunk.numel(), count * kv_block, d),
                values.view(1, chunk.numel(), count * kv_block, dv),
                _tail_bias(chunk_ids, nk, kv_block, tail_pad, q_rows.dtype),
                scale,
                with_lse=with_lse,
            )
            out.index_copy_(0, chunk, rows_out[0].contiguous())
            if lse is not None and rows_lse is not None:
                lse.index_copy_(0, chunk, rows_lse[0])
    return out, lse


def gather_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Block-sparse attention by packing kept blocks; [B, N, S, D] in and out.

    Args:
        q, k, v: BNSD tensors with the same batch and head counts.
        block_index: int [B, N, ceil(Sq / query block), K] key-block ids, -1 padded anywhere;
            a row lists a block at most once.
        block_size: tokens per block, an int or a (query, key) pair; the last block of either
            may be partial.
        scale: softmax scale; default ``D ** -0.5``.
        chunk_bytes: packed K+V bytes per SDPA call (tests shrink it to cross chunk edges).

    Returns:
        [B, N, Sq, Dv] in the dtype of ``q``. Query blocks that keep no key block get zeros.
    """
    check_same_heads(q, k, v)
    b, n, sq, _ = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    q_block, kv_block = block_shape(block_size)
    nq, nk = math.ceil(sq / q_block), math.ceil(sk / kv_block)
    tail_pad = nk * kv_block - sk
    q_rows = _as_block_rows(q, nq, q_block)
    k_rows = _as_block_rows(k, nk, kv_block).flatten(1)
    v_rows = _as_block_rows(v, nk, kv_block).flatten(1)
    shared = shared_blocks(block_index, nk)
    # torch does not differentiate the fused kernel's LSE output, so the merge is inference-only.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    split = q.device.type == "cpu" and not needs_grad and bool(shared.any())
    if not split:
        shared = torch.zeros_like(shared)
    ids = _global_block_ids(without_blocks(block_index, shared), nk)
    out, lse = _packed_attention(
        q_rows, k_rows, v_rows, ids, (nk, kv_block, tail_pad), dv, scale, chunk_bytes, split
    )
    out = out.view(b, n, nq * q_block, dv)[:, :, :sq]
    if split and lse is not None:
        lse = lse.view(b, n, nq * q_block)[:, :, :sq]
        out = merge_shared_blocks(q, k, v, out, lse, shared, kv_block, scale)
    return out


def block_sparse_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`gather_block_sparse_attention`, plus the log-sum-exp of every query row.

    For callers that merge several partial attentions (ring attention over K/V chunks): the
    output is [B, N, Sq, Dv] in ``q``'s dtype and the log-sum-exp [B, N, Sq] fp32, ``-inf`` on
    query rows that keep no key block here (their output rows are zeros). Only the kept blocks
    are packed and attended. Inference only (torch does not differentiate the fused kernel's
    log-sum-exp); on other devices than the CPU the rows are attended by an explicit fp32
    softmax.
    """
    check_same_heads(q, k, v)
    b, n, sq, _ = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    q_block, kv_block = block_shape(block_size)
    nq, nk = math.ceil(sq / q_block), math.ceil(sk / kv_block)
    ids = _global_block_ids(block_index, nk)
    out, lse = _packed_attention(
        _as_block_rows(q, nq, q_block),
        _as_block_rows(k, nk, kv_block).flatten(1),
        _as_block_rows(v, nk, kv_block).flatten(1),
        ids,
        (nk, kv_block, nk * kv_block - sk),
        dv,
        scale,
        chunk_bytes,
        True,
    )
    if lse is None:  # unreachable: asked for
        raise RuntimeError("no log-sum-exp computed")
    out = out.view(b, n, nq * q_block, dv)[:, :, :sq]
    return out, lse.view(b, n, nq * q_block)[:, :, :sq]


def merge_shared_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    shared: torch.Tensor,
    kv_block: int,
    scale: float | None,
) -> torch.Tensor:
    """Attend the ``shared`` key blocks (bool [nk]) with every query at once, merged by LSE.

    ``out`` [B, N, Sq, Dv] and ``lse`` [B, N, Sq] (fp32; very negative where a query attended
    nothing) are attention over the other blocks. One large-tile SDPA call over all queries runs at
    dense SDPA's full rate. CPU and inference only: torch neither exposes the fused kernel's LSE on
    other devices nor differentiates it.
    """
    return merge_shared_blocks_with_lse(q, k, v, out, lse, shared, kv_block, scale)[0]


def merge_shared_blocks_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    shared: torch.Tensor,
    kv_block: int,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_shared_blocks` plus the merged log-sum-exp [B, N, Sq] (fp32), for callers
    that merge further partial results (ring attention)."""
    tokens = (shared.nonzero() * kv_block + torch.arange(kv_block, device=q.device)).flatten()
    tokens = tokens[tokens < k.shape[-2]]  # the last block may be partial
    shared_out, shared_lse = _attend(
        q, k.index_select(2, tokens), v.index_select(2, tokens), None, scale, with_lse=True
    )
    total = torch.logaddexp(lse, shared_lse)
    weight = (lse - total).exp().unsqueeze(-1)
    shared_weight = (shared_lse - total).exp().unsqueeze(-1)
    merged = (out.float() * weight + shared_out.float() * shared_weight).to(out.dtype)
    return merged, total.float()
