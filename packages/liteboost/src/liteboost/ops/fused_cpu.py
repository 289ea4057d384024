"""The fused CPU block-sparse kernel, as one custom operator that ``torch.compile`` keeps whole.

The C++ loop lives in liteboost's CPU extension (:mod:`liteboost.ops.cpu_extension`, built once
per machine). It is forward-only fp32: other dtypes are computed in fp32, and when autograd
records, or where the extension cannot be built (logged once), the block-gather kernel runs
instead. Key blocks that every query row keeps are left to one dense SDPA call over all queries
and merged through the kernel's log-sum-exp, as in ``block_gather``.

Why a custom operator (``liteboost::fused_block_sparse_attention``): the extension call, the
data-dependent shared-block split (which blocks every row keeps, and their token list) and the
merge cannot be traced by dynamo, and each broke a caller's ``torch.compile`` graph. Registered
with ``torch.library.custom_op`` and a fake kernel that states the output shapes, the whole
path is one opaque node: the boosted transformer compiles into one graph with the CPU default
kernel. Eager calls run the operator's body directly: the operator's Python dispatch cost
measured 1.13x on a tiny (2 ms) call (``benchmarks/fused_operator.py``), and eager gains nothing
from it.
"""

from __future__ import annotations

import math

import torch

from liteboost.ops.block_gather import (
    block_sparse_attention_with_lse,
    gather_block_sparse_attention,
    merge_shared_blocks_with_lse,
    shared_blocks,
    without_blocks,
)
from liteboost.ops.blocks import BlockSize, block_shape, check_same_heads
from liteboost.ops.cpu_extension import load_cpu_kernel

OPERATOR = "liteboost::fused_block_sparse_attention"
"""The custom operator's qualified name (``torch.ops.liteboost.fused_block_sparse_attention``)."""


def fused_cpu_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-sparse flash attention on CPU; [B, N, S, D] in and out, dtype of ``q``.

    Args:
        q, k, v: BNSD CPU tensors with the same batch and head counts.
        block_index: int [B, N, ceil(Sq / query block), K] key-block ids, -1 padded anywhere;
            a row lists a block at most once.
        block_size: tokens per block, an int or a (query, key) pair; the last block of either
            may be partial.
        scale: softmax scale; default ``D ** -0.5``.

    Returns:
        [B, N, Sq, Dv]. Query blocks that keep no key block get zeros.
    """
    _check_cpu(q, k, v)
    if _records_autograd(q, k, v):
        return gather_block_sparse_attention(q, k, v, block_index, block_size, scale)
    out, _ = _fused_fp32(q, k, v, block_index, block_size, scale)
    return out.to(q.dtype)


def fused_cpu_block_sparse_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_cpu_block_sparse_attention` plus each query row's log-sum-exp.

    For callers that merge partial attentions (ring attention over K/V chunks), as
    :func:`liteboost.ops.block_gather.block_sparse_attention_with_lse`, whose contract this
    keeps: out [B, N, Sq, Dv] in ``q``'s dtype, lse [B, N, Sq] fp32, very negative (the kernel
    writes the lowest float) on rows that keep no key block here, whose output rows are zeros.
    Inference only; where the kernel cannot be built, or autograd records, the block-gather
    version runs.
    """
    _check_cpu(q, k, v)
    if _records_autograd(q, k, v):
        return block_sparse_attention_with_lse(q, k, v, block_index, block_size, scale)
    out, lse = _fused_fp32(q, k, v, block_index, block_size, scale)
    return out.to(q.dtype), lse


def _records_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # The operator has no backward (calling backward through it raises), so whenever autograd
    # records, the differentiable gather kernel runs; under torch.compile dynamo reads (and
    # guards on) the same flags.
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def _check_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_same_heads(q, k, v)
    if q.device.type != "cpu":
        raise ValueError(f"the 'cpu' sparse kernel needs CPU tensors; got device {q.device}")


def _fused_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    block_size: BlockSize,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator inside a caller's ``torch.compile`` graph, its body in eager mode."""
    q_block, kv_block = block_shape(block_size)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if torch.compiler.is_compiling():
        return fused_block_sparse_attention(q, k, v, block_index, q_block, kv_block, scale)
    return fused_attention_fp32(q, k, v, block_index, q_block, kv_block, scale)


def fused_attention_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    q_block: int,
    kv_block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [B, N, Sq, Dv], lse fp32 [B, N, Sq]) of block-sparse attention, both contiguous.

    The body of the ``liteboost::fused_block_sparse_attention`` operator, which graphs call
    (:data:`fused_block_sparse_attention`); eager callers call this directly and skip the
    operator's dispatch cost. The fused kernel where the extension loads, block gather
    (with its log-sum-exp) where it does not. Key blocks that every query row keeps run once for
    all queries at dense SDPA's rate and are merged through the kernel's log-sum-exp.
    """
    kernel = load_cpu_kernel()
    if kernel is None:
        out, lse = block_sparse_attention_with_lse(q, k, v, block_index, (q_block, kv_block), scale)
        return out.float().contiguous(), lse.contiguous()
    b, n, sq, _ = q.shape
    qf, kf, vf = (t.float() for t in (q, k, v))
    shared = shared_blocks(block_index, math.ceil(k.shape[2] / kv_block))
    has_shared = bool(shared.any())
    if has_shared:
        block_index = without_blocks(block_index, shared)
    rows = [t.reshape(b * n, t.shape[2], t.shape[3]) for t in (qf, kf, vf)]
    index = block_index.reshape(b * n, block_index.shape[2], block_index.shape[3]).long()
    out, lse = kernel.block_sparse_attention(*rows, index, q_block, kv_block, scale)
    out, lse = out.view(b, n, sq, v.shape[-1]), lse.view(b, n, sq)
    if has_shared:
        out, lse = merge_shared_blocks_with_lse(qf, kf, vf, out, lse, shared, kv_block, scale)
    # Contiguous, as the fake kernel promises (compiled graphs plan strides from it).
    return out.contiguous(), lse.contiguous()


fused_block_sparse_attention = torch.library.custom_op(
    OPERATOR, fused_attention_fp32, mutates_args=(), device_types="cpu"
)
"""The operator: :func:`fused_attention_fp32` as one opaque node for dynamo. Forward only: no
autograd formula is registered, so a backward through it raises instead of returning wrong
gradients (the wrappers above send autograd to block gather before it is reached)."""


@fused_block_sparse_attention.register_fake
def _fused_block_sparse_attention_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    q_block: int,
    kv_block: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, sq, _ = q.shape
    out = q.new_empty((b, n, sq, v.shape[-1]), dtype=torch.float32)
    return out, q.new_empty((b, n, sq), dtype=torch.float32)
