"""FlexAttention block-sparse kernel on CUDA (a Triton kernel) against dense masked SDPA.

The reference mask is built here from the block index, token by token, and the reference is
computed in fp64, so neither liteboost's mask expansion nor its reference kernel is trusted.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from liteboost.ops import plan_sparse_attention, rain_fusion_attention, sparse_attention
from liteboost.ops.rain_fusion import SparseKernel, default_kernel
from npu_core.bench import compare
from npu_core.testing import requires_cuda

pytestmark = [pytest.mark.device, requires_cuda]

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},  # IEEE fp32 (Inductor's default precision)
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _random_block_index(b, n, nq, nk, gen):
    """Rows keep 1..nk key blocks in random order, -1 padding at the end."""
    keep = torch.randint(1, nk + 1, (b, n, nq), generator=gen)
    order = torch.rand(b, n, nq, nk, generator=gen).argsort(-1).to(torch.int32)
    cols = torch.arange(nk).view(1, 1, 1, nk)
    return torch.where(cols < keep.unsqueeze(-1), order, -1)


def _token_mask(block_index, q_block, k_block, sq, sk):
    """bool [B, N, Sq, Sk]: query token i sees key token j iff j's block is listed for i's."""
    b, n, nq, _ = block_index.shape
    nk = math.ceil(sk / k_block)
    listed = torch.zeros(b, n, nq, nk, dtype=torch.int32, device=block_index.device)
    listed.scatter_add_(-1, block_index.clamp(min=0).long(), (block_index >= 0).int())
    q_blocks = torch.arange(sq, device=block_index.device) // q_block
    k_blocks = torch.arange(sk, device=block_index.device) // k_block
    return listed[:, :, q_blocks][..., k_blocks] > 0


def _reference(q, k, v, block_index, q_block, k_block):
    mask = _token_mask(block_index, q_block, k_block, q.shape[-2], k.shape[-2])
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    return out.to(q.dtype)


@pytest.mark.parametrize(
    ("dtype", "block_size"),
    [(torch.float32, 128), (torch.bfloat16, 128), (torch.bfloat16, (64, 128))],
    ids=["fp32-128", "bf16-128", "bf16-64x128"],
)
def test_flex_kernel_on_cuda_equals_masked_sdpa(dtype, block_size, record_property):
    """Ragged rows (1..nk blocks), a partial last block in queries and keys, head dim 128."""
    device = torch.device("cuda")
    q_block, k_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    b, n, s, d = 1, 4, 1000, 128  # 1000 = 7 x 128 + 104: the tail block is partial
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen).to(device, dtype) for _ in range(3))
    index = _random_block_index(b, n, math.ceil(s / q_block), math.ceil(s / k_block), gen)
    index = index.to(device)
    out = rain_fusion_attention(q, k, v, index, block_size=block_size, kernel="flex")
    ref = _reference(q, k, v, index, q_block, k_block)
    assert out.dtype == dtype and out.device.type == "cuda"
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    error = float((out.double() - ref.double()).abs().max())
    record_property("max_abs_error", f"{error:.2e}")
    print(f"flex {dtype} block {block_size}: max abs error {error:.2e}")


def test_sparse_attention_defaults_to_flex_on_cuda_and_matches_reference(record_property):
    """The whole call (tile, select, kernel, untile) on a Wan-like grid at sparsity 0.8."""
    device = torch.device("cuda")
    assert default_kernel(device) is SparseKernel.FLEX
    grid, heads, d = (3, 30, 52), 4, 128  # 4680 tokens
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, heads, math.prod(grid), d, generator=gen).to(device, torch.bfloat16)
        for _ in range(3)
    )
    out = sparse_attention(q, k, v, latent_shape=grid, sparsity=0.8)
    ref = sparse_attention(q, k, v, latent_shape=grid, sparsity=0.8, kernel="reference")
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.bfloat16])
    plan = plan_sparse_attention(q, k, latent_shape=grid, sparsity=0.8)
    record_property("kept_key_blocks_per_row", plan.keep)


def test_flex_sparse_speed_against_dense_sdpa_at_wan_480p(record_property):
    """Records (does not assert) the speed-up at Wan2.1 480p 81 frames, sparsity 0.8, bf16."""
    device = torch.device("cuda")
    grid, heads, d = (21, 30, 52), 12, 128  # 32760 tokens, Wan2.1 1.3B heads
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, heads, math.prod(grid), d, generator=gen).to(device, torch.bfloat16)
        for _ in range(3)
    )
    timing = compare(
        lambda: F.scaled_dot_product_attention(q, k, v),
        lambda: sparse_attention(q, k, v, latent_shape=grid, sparsity=0.8),
        warmup=2,
        repeats=10,
    )
    numbers = {
        "dense_sdpa_ms": round(1000 * timing.baseline.median, 3),
        "sparse_flex_ms": round(1000 * timing.candidate.median, 3),
        "speedup": round(timing.ratio_median, 2),
    }
    for key, value in numbers.items():
        record_property(key, value)
    print(f"flex sparse 0.8 vs dense SDPA at 480p: {numbers}")
    assert math.isfinite(timing.ratio_median)
