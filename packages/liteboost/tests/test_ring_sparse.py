"""Block-sparse ring attention: the single process's kept blocks, computed across gloo ranks.

Each rank holds a tile-order chunk (``tiled_chunk``); the concatenated outputs, restored to
raster order, must equal ``sparse_attention`` of the whole sequence (reference kernel), and the
ranks together must compute exactly the kept (query block, key block) pairs of the
single-process plan: nothing skipped, nothing extra.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from liteboost.ops import tiling
from liteboost.ops.blocks import block_shape
from liteboost.ops.sparse_attention import plan_sparse_attention, sparse_attention
from liteboost.parallel.ring import RingAttention, merge_partials, tiled_chunk
from npu_core.dist import launch

# 5 frames of 6 x 10 = 300 tokens: a partial last block, pad tokens in the last chunk.
GRID = (5, 6, 10)
CASES = [
    dict(sparsity=0.5, block_size=16),
    dict(sparsity=0.75, block_size=16),
    dict(sparsity=0.6, block_size=(32, 16)),
    dict(sparsity=0.6, block_size=16, first_frame_sink=False),
]


@torch.no_grad()
def _ring_rank(q, k, v, cases, kernel=None) -> list:
    ring = RingAttention(None)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        opts = {key: val for key, val in case.items() if key != "sparsity"}
        chunks = [tiled_chunk(t, GRID, world, rank, **opts) for t in (q, k, v)]
        out = ring.sparse(
            *chunks, latent_shape=GRID, sparsity=case["sparsity"], kernel=kernel, **opts
        )
        results.append((out, ring.attended_blocks))
    return results


def _kept_pairs(q, k, case) -> int:
    plan = plan_sparse_attention(
        q,
        k,
        latent_shape=GRID,
        sparsity=case["sparsity"],
        block_size=case["block_size"],
        first_frame_sink=case.get("first_frame_sink", True),
    )
    return int((plan.block_index >= 0).sum())


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("world", "kernel"),
    [(2, None), (3, None), (2, "gather")],
    ids=["2-fused", "3-fused", "2-gather"],
)
def test_sparse_ring_equals_single_process_sparse_attention(world, kernel, qkv_factory):
    """The chunks run the fused CPU kernel by default (``None`` on CPU), or block gather."""
    q, k, v = qkv_factory(GRID, heads=2, dim=16, batch=2)
    per_rank = launch(_ring_rank, world, q, k, v, CASES, kernel, timeout=900)
    seq = math.prod(GRID)
    for i, case in enumerate(CASES):
        opts = {key: val for key, val in case.items() if key != "sparsity"}
        expected = sparse_attention(
            q, k, v, latent_shape=GRID, kernel="reference", sparsity=case["sparsity"], **opts
        )
        tiled = torch.cat([rank_results[i][0] for rank_results in per_rank], dim=2)[:, :, :seq]
        kv_block = block_shape(case["block_size"])[1]
        layout = tiling.tile_layout(
            GRID, tiling.default_tile(kv_block), "cpu", case.get("first_frame_sink", True)
        )
        got = tiling.restore(tiled, layout, seq_dim=2)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=f"case {case}")
        attended = sum(rank_results[i][1] for rank_results in per_rank)
        assert attended == _kept_pairs(q, k, case), case
        total_pairs = math.ceil(seq / block_shape(case["block_size"])[0]) * math.ceil(
            seq / kv_block
        )
        assert attended < total_pairs * q.shape[0] * q.shape[1], "sparse: some pairs skipped"


def test_merge_of_rows_that_attended_nothing_stays_zero():
    """Sparse chunks leave rows with lse -inf; two such partials merge to 0, not NaN."""
    out = torch.zeros(1, 1, 2, 4)
    lse = torch.tensor([[[-math.inf, 0.5]]])
    part = torch.ones(1, 1, 2, 4)
    part_lse = torch.tensor([[[-math.inf, -math.inf]]])
    merged, merged_lse = merge_partials(out, lse, part, part_lse)
    assert torch.equal(merged[0, 0, 0], torch.zeros(4))
    assert torch.equal(merged[0, 0, 1], torch.zeros(4))  # the old row, weight 1
    assert merged_lse[0, 0, 0] == -math.inf and merged_lse[0, 0, 1] == 0.5


def test_fused_kernel_with_lse_equals_gather_with_lse(qkv_factory, cpu_kernel):
    """The fused kernel's (out, lse), shared blocks merged in, equal block gather's, including
    query blocks that keep nothing in this chunk (lse very negative, output zero)."""
    from liteboost.ops.block_gather import block_sparse_attention_with_lse
    from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention_with_lse

    q, k, v = qkv_factory((2, 4, 8), heads=2, dim=16, batch=1)  # 64 tokens, 4 blocks of 16
    index = torch.tensor([[0, 2, -1], [0, -1, -1], [-1, -1, -1], [0, 3, 1]], dtype=torch.int32)
    index = index.expand(1, 2, 4, 3).contiguous()  # block 0 kept by 3 of 4 rows: not shared
    for idx in (index, index.flip(-1).contiguous()):  # -1 padding anywhere in a row
        out, lse = fused_cpu_block_sparse_attention_with_lse(q, k, v, idx, 16)
        ref_out, ref_lse = block_sparse_attention_with_lse(q, k, v, idx, 16)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        attended = ref_lse > -1e30
        torch.testing.assert_close(lse[attended], ref_lse[attended], atol=1e-5, rtol=1e-5)
        assert (lse[~attended] < -1e30).all() and (out[..., 32:48, :] == 0).all()
    shared = torch.tensor([[0, 2], [0, 1], [0, 3], [0, 1]], dtype=torch.int32).expand(1, 2, 4, 2)
    out, lse = fused_cpu_block_sparse_attention_with_lse(q, k, v, shared.contiguous(), 16)
    ref_out, ref_lse = block_sparse_attention_with_lse(q, k, v, shared.contiguous(), 16)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
