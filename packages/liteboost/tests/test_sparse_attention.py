"""Block-sparse attention: kernels match the dense-mask reference; selection keeps what it must.

FlexAttention compiles once per shape (8-35 s on CPU), so every flex test here uses the one
shape (batch 2, 2 heads, ``GRID`` tokens, head dim 12); the compiled kernel is reused. The
block-gather kernel compiles nothing and is tested on odd shapes as well.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from liteboost.ops import plan_sparse_attention, rain_fusion_attention, sparse_attention, tiling
from liteboost.ops.block_gather import gather_block_sparse_attention
from liteboost.ops.blocks import block_index_to_dense
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention
from liteboost.ops.reference import reference_block_sparse_attention

# The first FlexAttention or fused-kernel call compiles (Inductor's C++ template, the kernel's
# cpp_extension build), once per vector ISA: minutes on a loaded two-core machine. The timeout
# only catches hangs, so it leaves room for that.
pytestmark = pytest.mark.timeout(900)

# 216 tokens: 14 blocks of 16, the last one partial (8 tokens); frame 0 = 72 tokens, in blocks 0-4.
# test_boost.py runs the tiny Wan on the same shape, so one compiled kernel serves both files.
GRID = (3, 8, 9)
NB = 14
BLOCK = 16


def _random_block_index(b, n, nq, nk, gen):
    keep = torch.randint(1, nk + 1, (b, n, nq), generator=gen)
    scores = torch.rand(b, n, nq, nk, generator=gen)
    order = scores.argsort(-1).to(torch.int32)
    cols = torch.arange(nk).view(1, 1, 1, nk)
    return torch.where(cols < keep.unsqueeze(-1), order, -1)


def test_flex_kernel_matches_reference_with_ragged_rows(qkv_factory):
    """Compiled FlexAttention equals SDPA under the same block mask; rows keep 1..nk blocks."""
    q, k, v = qkv_factory(GRID, heads=2, batch=2)
    nb = math.ceil(q.shape[2] / BLOCK)
    index = _random_block_index(2, 2, nb, nb, torch.Generator().manual_seed(1))
    flex = rain_fusion_attention(q, k, v, index, block_size=BLOCK, kernel="flex")
    ref = rain_fusion_attention(q, k, v, index, block_size=BLOCK, kernel="reference")
    torch.testing.assert_close(flex, ref, atol=2e-5, rtol=1e-4)


def _shuffled(index, gen):
    """The same kept blocks with the -1 padding moved to random positions in each row."""
    order = torch.rand(index.shape, generator=gen).argsort(-1)
    return index.gather(-1, order)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["many-chunks", "one-chunk"])
def test_gather_kernel_matches_reference_with_ragged_rows(qkv_factory, chunk_bytes):
    """Rows keep 1..nk blocks, padding anywhere in the row, partial last block, chunk edges."""
    q, k, v = qkv_factory(GRID, heads=2, batch=2)
    gen = torch.Generator().manual_seed(1)
    index = _shuffled(_random_block_index(2, 2, NB, NB, gen), gen)
    out = gather_block_sparse_attention(q, k, v, index, BLOCK, chunk_bytes=chunk_bytes)
    ref = reference_block_sparse_attention(q, k, v, index, BLOCK)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["gather", "cpu"])
def test_kernels_merge_blocks_every_row_keeps(qkv_factory, dtype, kernel):
    """Blocks listed in every row (a sink and the partial tail block) are attended once by all
    queries and merged by log-sum-exp; some rows keep nothing else."""
    q, k, v = qkv_factory(GRID, heads=2, batch=2)
    gen = torch.Generator().manual_seed(6)
    others = _random_block_index(2, 2, NB, NB - 2, gen) + 1  # ids 1..12, -1 stays 0
    others = torch.where(others > 0, others, -1)
    others[..., 3, :] = -1  # this row keeps only the shared blocks
    shared = torch.tensor([0, NB - 1], dtype=torch.int32).expand(2, 2, NB, 2)
    index = _shuffled(torch.cat([shared, others], dim=-1), gen)
    ref = reference_block_sparse_attention(q, k, v, index, BLOCK)
    low = [t.to(dtype) for t in (q, k, v)]
    if kernel == "gather":
        out = gather_block_sparse_attention(*low, index, BLOCK, chunk_bytes=1)
    else:
        out = fused_cpu_block_sparse_attention(*low, index, BLOCK)
    assert out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_gather_kernel_gradients_match_reference(qkv_factory):
    """Backward through packing equals the reference (a block every row keeps is packed too)."""
    gen = torch.Generator().manual_seed(7)
    index = _shuffled(_random_block_index(1, 2, NB, NB, gen), gen)
    index[..., 0] = 0  # kept by every row: the (inference-only) shared split must step aside
    index = torch.where((index == 0) & (torch.arange(NB) > 0), -1, index)
    grads = []
    for kernel in (gather_block_sparse_attention, reference_block_sparse_attention):
        q, k, v = (t.clone().requires_grad_() for t in qkv_factory(GRID))
        kernel(q, k, v, index, BLOCK).square().sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gather_kernel_with_more_keys_than_queries_and_bf16():
    """Sq != Sk (both partial tails), bf16, explicit scale: the fp32 reference agrees."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 3, 40, 8, generator=gen)
    k, v = (torch.randn(1, 3, 70, 8, generator=gen) for _ in range(2))
    index = _shuffled(_random_block_index(1, 3, 3, 5, gen), gen)
    ref = reference_block_sparse_attention(q, k, v, index, 16, scale=0.2)
    out = rain_fusion_attention(
        *(t.bfloat16() for t in (q, k, v)), index, block_size=16, scale=0.2, kernel="gather"
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "kernel", [gather_block_sparse_attention, fused_cpu_block_sparse_attention]
)
def test_kernels_give_zeros_for_rows_without_blocks_and_check_heads(kernel):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 32, 4, generator=gen) for _ in range(3))
    index = torch.tensor([[[[1, -1], [-1, -1]]]])
    out = kernel(q, k, v, index, 16)
    assert torch.equal(out[..., 16:, :], torch.zeros(1, 1, 16, 4))
    torch.testing.assert_close(
        out[..., :16, :],
        F.scaled_dot_product_attention(q[..., :16, :], k[..., 16:, :], v[..., 16:, :]),
    )
    with pytest.raises(ValueError, match="share batch and head counts"):
        kernel(q, k.expand(1, 2, 32, 4), v, index, 16)


def test_reference_kernel_is_masked_sdpa_on_a_partial_tail_block():
    """The reference expands blocks to tokens correctly when S is not a block multiple."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 50, 8, generator=gen) for _ in range(3))
    index = torch.tensor([[[[0, -1, -1, -1], [1, 3, -1, -1], [2, -1, -1, -1], [3, 0, -1, -1]]]])
    out = reference_block_sparse_attention(q, k, v, index, 16)
    dense = block_index_to_dense(index, 4)[0, 0]
    for row in range(50):
        cols = [c for c in range(50) if dense[row // 16, c // 16]]
        expect = F.scaled_dot_product_attention(
            q[:, :, row : row + 1], k[:, :, cols], v[:, :, cols]
        )
        torch.testing.assert_close(out[:, :, row : row + 1], expect)


def test_bsnd_layout_matches_bnsd(qkv_factory):
    q, k, v = qkv_factory(GRID)
    nb = math.ceil(q.shape[2] / BLOCK)
    index = _random_block_index(1, 2, nb, nb, torch.Generator().manual_seed(2))
    bnsd = rain_fusion_attention(q, k, v, index, block_size=BLOCK, kernel="reference")
    bsnd = rain_fusion_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        index,
        block_size=BLOCK,
        layout="BSND",
        kernel="reference",
    )
    torch.testing.assert_close(bsnd.transpose(1, 2), bnsd)


def test_sparsity_zero_is_dense_attention(qkv_factory):
    q, k, v = qkv_factory(GRID)
    out = sparse_attention(q, k, v, latent_shape=GRID, sparsity=0.0, block_size=BLOCK)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("kernel", ["cpu", "gather", "flex"])
def test_keeping_every_block_equals_dense(qkv_factory, kernel):
    """The sparse path itself (tile, kernel, untile) is exact when nothing is dropped."""
    q, k, v = qkv_factory(GRID, batch=2)
    plan = plan_sparse_attention(q, k, latent_shape=GRID, sparsity=0.01, block_size=BLOCK)
    assert plan.keep == math.ceil(q.shape[2] / BLOCK)
    out = sparse_attention(
        q, k, v, latent_shape=GRID, sparsity=0.01, block_size=BLOCK, kernel=kernel
    )
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=2e-5, rtol=1e-4)


def test_sparsity_half_stays_close_on_structured_inputs(qkv_factory):
    """At sparsity 0.5 top-k selection stays close to dense, and beats random selection by far."""
    q, k, v = qkv_factory(GRID, batch=2)
    dense = F.scaled_dot_product_attention(q, k, v)
    out = sparse_attention(
        q, k, v, latent_shape=GRID, sparsity=0.5, block_size=BLOCK, kernel="flex"
    )
    rel = ((out - dense).norm() / dense.norm()).item()
    plan = plan_sparse_attention(q, k, latent_shape=GRID, sparsity=0.5, block_size=BLOCK)
    # Same budget, blocks chosen at random: the first `keep` entries of a random permutation.
    order = torch.rand(2, 2, NB, NB, generator=torch.Generator().manual_seed(4)).argsort(-1)
    random_index = order[..., : plan.keep].to(torch.int32)
    tiled = [tiling.reorder(t, plan.layout, 2) for t in (q, k, v)]
    rnd = tiling.restore(
        reference_block_sparse_attention(*tiled, random_index, BLOCK), plan.layout, 2
    )
    rel_random = ((rnd - dense).norm() / dense.norm()).item()
    assert rel < 0.1, rel
    assert rel < 0.5 * rel_random, (rel, rel_random)


@pytest.mark.parametrize("q_block", [BLOCK, 2 * BLOCK])
def test_first_frame_and_text_blocks_are_always_kept(qkv_factory, q_block):
    """At sparsity 0.9 every video query row still lists all first-frame and text key blocks,
    with square blocks and with query blocks twice the key blocks."""
    text_len = 20
    q, k, _ = qkv_factory(GRID, text_len=text_len)
    plan = plan_sparse_attention(
        q, k, latent_shape=GRID, text_len=text_len, sparsity=0.9, block_size=(q_block, BLOCK)
    )
    nk = math.ceil((216 + text_len) / BLOCK)  # 15 key blocks; block 13 mixes video and text
    video_q = 216 // q_block  # query rows holding video tokens only
    assert plan.block_index.shape[2] == math.ceil((216 + text_len) / q_block)
    dense = block_index_to_dense(plan.block_index, nk)
    video_rows = dense[..., :video_q, :]
    assert video_rows[..., :5].all(), "first-frame blocks (72 tokens, blocks 0-4) must be kept"
    assert video_rows[..., 13:].all(), "text blocks must be kept"
    assert dense[..., video_q:, :].all(), "text query rows attend every block"
    assert video_rows.sum(-1).max() == plan.keep < nk


def test_masks_are_per_batch_element(qkv_factory):
    """Two batch elements with different content get different masks, each equal to its own plan."""
    q0, k0, _ = qkv_factory(GRID, seed=0)
    q1, k1, _ = qkv_factory(GRID, seed=5)
    q, k = torch.cat([q0, q1]), torch.cat([k0, k1])
    both = plan_sparse_attention(q, k, latent_shape=GRID, sparsity=0.6, block_size=BLOCK)
    alone0 = plan_sparse_attention(q0, k0, latent_shape=GRID, sparsity=0.6, block_size=BLOCK)
    alone1 = plan_sparse_attention(q1, k1, latent_shape=GRID, sparsity=0.6, block_size=BLOCK)
    d = [block_index_to_dense(p.block_index, NB) for p in (both, alone0, alone1)]
    assert torch.equal(d[0][0], d[1][0]) and torch.equal(d[0][1], d[2][0])
    assert not torch.equal(d[0][0], d[0][1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparsity": 1.0}, "sparsity=1.0"),
        ({"sparsity": 0.5, "layout": "SBND"}, "layout='SBND'"),
        ({"sparsity": 0.5, "latent_shape": (3, 8, 10)}, r"latent_shape=\(3, 8, 10\).*216 tokens"),
    ],
)
def test_bad_arguments_name_the_problem(qkv_factory, kwargs, match):
    q, k, v = qkv_factory(GRID)
    args = {"latent_shape": GRID, "block_size": BLOCK, **kwargs}
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, **args)


def test_a_sparsity_that_keeps_every_block_runs_dense_attention(qkv_factory):
    """0.01 of 14 key blocks keeps all 14: the call is the dense chain's, bit for bit (measured
    faster than the reordered path with every block kept; that path sums keys in tile order, so
    it would not be bit-identical); a forced kernel still runs and agrees."""
    q, k, v = qkv_factory(GRID, heads=2, batch=2)
    plan = plan_sparse_attention(q, k, latent_shape=GRID, sparsity=0.01, block_size=BLOCK)
    assert plan.keep == NB
    dense = F.scaled_dot_product_attention(q, k, v)
    out = sparse_attention(q, k, v, latent_shape=GRID, sparsity=0.01, block_size=BLOCK)
    assert torch.equal(out, dense)
    forced = sparse_attention(
        q, k, v, latent_shape=GRID, sparsity=0.01, block_size=BLOCK, kernel="gather"
    )
    torch.testing.assert_close(forced, dense, atol=2e-5, rtol=1e-4)
