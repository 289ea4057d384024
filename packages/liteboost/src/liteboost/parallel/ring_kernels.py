"""Ring attention's per-chunk kernels as registered plug-ins, each returning (out, log-sum-exp).

Ring attention merges the partial results of K/V chunks by their log-sum-exps, so every chunk
kernel returns one next to its output. Two registries hold them: ``RING_DENSE_KERNELS`` (dense
chunks) and ``RING_SPARSE_KERNELS`` (block-sparse chunks). Both are ``npu_core.plugins``
registries, chosen by the rule the attention backends (``liteboost.attention.backends``) and the
sparse kernels (``liteboost.ops.sparse_kernels``) follow: the first kernel in priority order that
is installed and accepts the call's device and dtype; a forced kernel that cannot take the call
raises; each distinct choice is logged once at INFO (logger ``npu_core.plugins``). Another
package, or a test, adds a kernel with ``RING_DENSE_KERNELS.register(Plugin(...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from liteboost.ops.block_gather import block_sparse_attention_with_lse
from liteboost.ops.blocks import BlockSize
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention_with_lse
from npu_core.plugins import DeviceDtype, Plugin, Registry

DenseChunkKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
"""(q, k, v, scale) -> (out, lse): BNSD inputs, out in q's dtype, lse [B, N, S] fp32."""

SparseChunkKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BlockSize, float | None],
    tuple[torch.Tensor, torch.Tensor],
]
"""(q, k, v, block_index, block_size, scale) -> (out, lse), as the dense kernels, BNSD."""


@dataclass(frozen=True)
class ChunkCall:
    """The facts of one chunk call that the kernels' constraints look at.

    Attributes:
        device: device type of q, k and v ("cpu", "cuda", "npu", ...).
        dtype: their dtype.
    """

    device: str
    dtype: torch.dtype

    @classmethod
    def of(cls, q: torch.Tensor) -> ChunkCall:
        """Describe the chunks of a ring whose queries are ``q`` (k and v share its device)."""
        return cls(q.device.type, q.dtype)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CUDA_EFFICIENT_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def flash_cpu_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's fused CPU flash-attention kernel, which returns the log-sum-exp it computes."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, scale=scale
    )
    return out, lse.float()


def efficient_cuda_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's memory-efficient kernel; its log-sum-exp is padded along S, cut back here."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def math_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """An explicit fp32 softmax: any device, [B, N, S, S] scores in memory."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, lse


RING_DENSE_KERNELS: Registry[DenseChunkKernel, ChunkCall] = Registry("ring dense chunk kernel")
"""Dense chunk kernels: "flash_cpu" on CPU, "efficient_cuda" on CUDA, "math" anywhere else."""

RING_SPARSE_KERNELS: Registry[SparseChunkKernel, ChunkCall] = Registry("ring sparse chunk kernel")
"""Block-sparse chunk kernels: "cpu" (fused C++) on CPU, "gather" anywhere else."""

_DENSE_PLUGINS: tuple[Plugin[DenseChunkKernel, ChunkCall], ...] = (
    Plugin("flash_cpu", flash_cpu_with_lse, DeviceDtype(("cpu",), _FLOATS), priority=10),
    Plugin(
        "efficient_cuda",
        efficient_cuda_with_lse,
        DeviceDtype(("cuda",), _CUDA_EFFICIENT_FLOATS),
        priority=20,
    ),
    Plugin("math", math_with_lse, DeviceDtype(None, _FLOATS), priority=90),
)
_SPARSE_PLUGINS: tuple[Plugin[SparseChunkKernel, ChunkCall], ...] = (
    # The fused kernel measured faster than block gather per chunk (benchmarks/ring_sparse.py);
    # where its extension cannot be built, or autograd records, it runs block gather itself.
    Plugin(
        "cpu",
        fused_cpu_block_sparse_attention_with_lse,
        DeviceDtype(("cpu",), _FLOATS),
        priority=20,
    ),
    Plugin("gather", block_sparse_attention_with_lse, DeviceDtype(None, _FLOATS), priority=40),
)
for _dense in _DENSE_PLUGINS:
    RING_DENSE_KERNELS.register(_dense)
for _sparse in _SPARSE_PLUGINS:
    RING_SPARSE_KERNELS.register(_sparse)


def select_dense_kernel(call: ChunkCall) -> Plugin[DenseChunkKernel, ChunkCall]:
    """The dense chunk kernel for ``call``: the first registered one that accepts it.

    Raises:
        npu_core.plugins.PluginError: no registered kernel takes the call's device and dtype.
    """
    return RING_DENSE_KERNELS.select(call)


def select_sparse_kernel(
    call: ChunkCall, forced: str | None = None
) -> Plugin[SparseChunkKernel, ChunkCall]:
    """The block-sparse chunk kernel for ``call``: ``forced`` if given, else the first that fits.

    Raises:
        npu_core.plugins.PluginError: (a ValueError) an unknown name, a forced kernel that does
            not take the call (``"cpu"`` on CUDA tensors), or none that does.
    """
    return RING_SPARSE_KERNELS.select(call, forced)
