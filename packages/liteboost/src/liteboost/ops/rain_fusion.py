"""Block-sparse attention: for each query block, attend only the listed key blocks.

One signature over five registered kernels (``liteboost.ops.sparse_kernels``): the Ascend
``RainFusionAttention`` op (``npu_kernel``), a fused C++ CPU kernel (``fused_cpu``, the CPU
default), block gather (``block_gather``: kept blocks packed, then stock SDPA; differentiable,
the fallback), FlexAttention with a ``BlockMask`` (``flex``, the cuda default) and a dense-mask
reference for tests (``reference``). Which kernel runs is the registry's one rule, logged once
per choice. Choosing *which blocks* to keep is ``liteboost.ops.sparse_attention``'s job.
"""

from __future__ import annotations

import math

import torch

from liteboost.ops.blocks import BlockSize, block_shape, check_qkv
from liteboost.ops.sparse_kernels import SparseCall, SparseKernel, select_kernel

__all__ = [
    "SparseKernel",
    "check_layout",
    "default_kernel",
    "from_bnsd",
    "rain_fusion_attention",
    "to_bnsd",
]

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


def default_kernel(device: torch.device, dtype: torch.dtype = torch.float32) -> SparseKernel:
    """The kernel an unforced inference call on ``device`` gets (the registry's rule)."""
    plugin = select_kernel(SparseCall(torch.device(device).type, dtype))
    return SparseKernel(plugin.name)


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
        kernel: force "npu", "cpu", "gather", "flex" or "reference" (refused with the reason
            when it cannot take the call); default: the first registered kernel that is
            installed and accepts the call (``sparse_kernels``): the NPU op on an NPU that has
            it, "cpu" on CPU, "flex" on CUDA, "gather" elsewhere and whenever autograd records.

    Returns:
        The attention output in ``layout``, dtype of ``q``.

    Raises:
        ValueError: bad q/k/v (see ``blocks.check_qkv``), layout or ``block_index`` shape; a
            ``npu_core.plugins.PluginError`` (a ValueError) for an unknown or refusing kernel.
    """
    check_layout(layout)
    check_qkv(q, k, v, layout, same_tokens=False)
    shape = block_shape(block_size)
    qb, kb, vb = (to_bnsd(t, layout) for t in (q, k, v))
    expected = (qb.shape[0], qb.shape[1], math.ceil(qb.shape[-2] / shape[0]))
    if block_index.dim() != 4 or tuple(block_index.shape[:3]) != expected:
        raise ValueError(
            f"block_index has shape {tuple(block_index.shape)}; expected [B, N, nq, K] with "
            f"[B, N, nq] = {list(expected)} for block_size={block_size}"
        )
    plugin = select_kernel(SparseCall.of(qb, kb, vb, forced=kernel is not None), kernel)
    out = plugin.impl(qb, kb, vb, block_index, shape, scale)
    return from_bnsd(out, layout)
