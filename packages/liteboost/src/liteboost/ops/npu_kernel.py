"""The Ascend NPU block-sparse kernel: torch_npu's ``npu_rain_fusion_attention``.

The only liteboost module that calls torch_npu's sparse op; torch_npu itself is imported lazily
through ``npu_core.npu``, so importing this module touches no device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from liteboost.ops.blocks import BlockSize, block_shape
from npu_core.npu import import_torch_npu


@functools.cache
def npu_op() -> Callable[..., torch.Tensor] | None:
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
    op = npu_op()
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
