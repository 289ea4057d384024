"""Block-sparse attention: for each query block, attend only the listed key blocks.

Five kernels behind one signature: the Ascend ``RainFusionAttention`` op when torch_npu provides
it, a fused C++ CPU kernel (online softmax over the listed blocks, built once per machine; the
CPU default, see ``fused_cpu``), the block-gather kernel (kept blocks packed, then stock SDPA; the
CPU fallback and the differentiable CPU path, see ``block_gather``), FlexAttention with a
``BlockMask`` (compiled once per shape, cached; the cuda default), and a pure-PyTorch dense-mask
reference kept for tests. Choosing *which* blocks to keep is
``liteboost.ops.sparse_attention``'s job.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from liteboost.ops.block_gather import gather_block_sparse_attention
from liteboost.ops.blocks import BlockSize, block_index_to_dense, block_shape
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention
from npu_core._npu import import_torch_npu

logger = logging.getLogger(__name__)


class SparseKernel(enum.StrEnum):
    """Kernels that run ``rain_fusion_attention``."""

    NPU = "npu"
    CPU = "cpu"
    GATHER = "gather"
    FLEX = "flex"
    REFERENCE = "reference"


_LAYOUTS = ("BNSD", "BSND")


def check_layout(layout: str) -> None:
    """Raise a ValueError naming the allowed layouts when ``layout`` is not one of them."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use one of {_LAYOUTS}")


def to_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """View ``x`` as [B, N, S, D] (a transpose for BSND, no copy)."""
    return x if layout == "BNSD" else x.transpose(1, 2)


def from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`to_bnsd`."""
    return x if layout == "BNSD" else x.transpose(1, 2)


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


def build_block_mask(block_index: torch.Tensor, block_size: BlockSize, seq_len: tuple[int, int]):
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
    block_mask=None,
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


@functools.cache
def _npu_op() -> Callable[..., torch.Tensor] | None:
    torch_npu = import_torch_npu()
    if torch_npu is None:
        return None
    return getattr(torch_npu, "npu_rain_fusion_attention", None)


def npu_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> torch.Tensor:
    """Ascend RainFusionAttention (aclnnRainFusionAttention); [B, N, S, D] in and out.

    Argument names follow the aclnn interface (select_idx [.., nq, K] padded with -1,
    select_num_idx [.., nq], block_shape). Not exercised on this project's CI (no NPU).
    """
    op = _npu_op()
    if op is None:
        raise RuntimeError("torch_npu with npu_rain_fusion_attention is not available here")
    counts = (block_index >= 0).sum(-1, dtype=torch.int32)
    return op(
        q,
        k,
        v,
        select_idx=block_index.to(torch.int64),
        select_num_idx=counts.to(torch.int64),
        block_shape=list(block_shape(block_size)),
        q_input_layout="BNSD",
        kv_input_layout="BNSD",
        num_key_value_heads=k.shape[1],
        scale_value=scale if scale is not None else q.shape[-1] ** -0.5,
    )


def default_kernel(device: torch.device) -> SparseKernel:
    """NPU op on an NPU device that provides it, the fused kernel on CPU, else FlexAttention.

    On CPU the fused kernel measured fastest at sparsity 0.8, ahead of block gather and
    FlexAttention (benchmarks/sparse_attention.py); on cuda FlexAttention is a fused Triton kernel.
    """
    if device.type == "npu" and _npu_op() is not None:
        return SparseKernel.NPU
    if device.type == "cpu":
        return SparseKernel.CPU
    return SparseKernel.FLEX


_KERNELS = {
    SparseKernel.NPU: npu_block_sparse_attention,
    SparseKernel.CPU: fused_cpu_block_sparse_attention,
    SparseKernel.GATHER: gather_block_sparse_attention,
    SparseKernel.FLEX: flex_block_sparse_attention,
    SparseKernel.REFERENCE: reference_block_sparse_attention,
}


def rain_fusion_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    *,
    block_size: BlockSize = 128,
    scale: float | None = None,
    layout: str = "BNSD",
    kernel: SparseKernel | str | None = None,
) -> torch.Tensor:
    """Block-sparse attention: query block i attends only key blocks ``block_index[..., i, :]``.

    Args:
        q: [B, N, Sq, D] (layout "BNSD") or [B, Sq, N, D] ("BSND"); fp32, bf16 or fp16.
        k: like ``q`` with Sk tokens.
        v: like ``k``.
        block_index: int [B, N, ceil(Sq / query block), K] key-block ids per query block, padded
            with -1 (rows may keep different numbers of blocks). Every row must keep >= 1 block.
        block_size: tokens per block: an int for queries and keys alike, or a (query, key) pair;
            the last block of either may be partial.
        scale: softmax scale; default ``D ** -0.5``.
        layout: "BNSD" or "BSND", for inputs and output alike.
        kernel: force "npu", "cpu", "gather", "flex" or "reference"; default: the NPU op where
            present, "cpu" on CPU, else "flex".

    Returns:
        The attention output in ``layout``, dtype of ``q``.
    """
    check_layout(layout)
    shape = block_shape(block_size)
    qb, kb, vb = (to_bnsd(t, layout) for t in (q, k, v))
    expected = (qb.shape[0], qb.shape[1], math.ceil(qb.shape[-2] / shape[0]))
    if block_index.dim() != 4 or tuple(block_index.shape[:3]) != expected:
        raise ValueError(
            f"block_index has shape {tuple(block_index.shape)}; expected [B, N, nq, K] with "
            f"[B, N, nq] = {list(expected)} for block_size={block_size}"
        )
    kernel = SparseKernel(kernel) if kernel is not None else default_kernel(qb.device)
    out = _KERNELS[kernel](qb, kb, vb, block_index, shape, scale)
    return from_bnsd(out, layout)
