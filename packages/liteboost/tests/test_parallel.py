"""Ulysses and VAE temporal parallelism on real gloo ranks equal the single-process result.

One launch per world size runs every check (rank start-up, not the checks, dominates here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import liteboost
from liteboost.tiny import build_tiny_transformer, build_tiny_vae
from npu_core.dist import launch
from packages.liteboost.tests.token_counts import forward_counting_tokens

pytestmark = pytest.mark.distributed

GRIDS = [(3, 4, 4), (1, 5, 7)]  # 48 and 35 tokens: 35 is uneven for 2 and 3 ranks
SPARSE_GRID = (3, 4, 8)


# VAE: 1 frame (fewer frames than ranks), and clips whose windows are shorter than the clip
# (5 latents at 3 ranks: 2, 2 and 1). Windows past frame 0 and batch slicing are covered without
# ranks in test_vae_dp.py (they need clips longer than the receptive field: slow on 3 ranks).
DECODE_FRAMES = [1, 5, 9]
ENCODE_FRAMES = [1, 9, 17]


@torch.no_grad()
def _ulysses_rank(data: dict) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    model = build_tiny_transformer()
    for grid in GRIDS:
        inputs = data["grids"][grid]
        stock, out[f"stock_tokens{grid}"] = forward_counting_tokens(model, inputs)
        with liteboost.ParallelManager(model) as manager:
            assert manager.parallelized == ["model"]
            parallel, out[f"tokens{grid}"] = forward_counting_tokens(model, inputs)
        out[f"dense{grid}"] = (parallel - stock).abs().max().item()
        with liteboost.BoostManager(model):
            boosted = model(**inputs).sample
            with liteboost.ParallelManager(model):
                both = model(**inputs).sample
        out[f"boosted{grid}"] = (both - boosted).abs().max().item()
    inputs = data["sparse"]
    with liteboost.BoostManager(model, sparsity=0.5, block_size=16, sparse_kernel="reference"):
        sparse = model(**inputs).sample
        with liteboost.ParallelManager(model):
            sparse_parallel = model(**inputs).sample
    out["sparse"] = (sparse_parallel - sparse).abs().max().item()
    for variant in ("i2v", "ti2v"):  # image K/V branch, per-token timestep (uneven: 35 tokens)
        variant_model = build_tiny_transformer(**(data["i2v_config"] if variant == "i2v" else {}))
        inputs = data[variant]
        stock = variant_model(**inputs).sample
        with liteboost.ParallelManager(variant_model):
            parallel = variant_model(**inputs).sample
        out[variant] = (parallel - stock).abs().max().item()
    try:
        liteboost.ParallelManager(model, pad_heads=False)
        out["refusal"] = None
    except ValueError as exc:
        out["refusal"] = str(exc)
    out["seed"] = liteboost.ParallelManager.sync_seed(1000 + rank)
    # The single-process reference runs in this rank, i.e. at the rank's thread count: stock
    # itself may round differently at another thread count (see liteboost.parallel.vae_dp).
    vae = build_tiny_vae()
    latents, pixels = data["latents"], data["pixels"]
    out["vae_stock"] = {t: vae.decode(latents[t]).sample for t in DECODE_FRAMES}
    out["encode_stock"] = {t: vae.encode(pixels[t]).latent_dist.mean for t in ENCODE_FRAMES}
    # The temporal mode is the bit-identical one; the spatial mode (picked by shape) is checked
    # to float rounding in test_hybrid_parallel.py.
    with liteboost.ParallelManager(vae, vae_mode="temporal") as manager:
        out["vae_parallelized"] = manager.parallelized
        out["vae"] = {t: vae.decode(latents[t]).sample for t in DECODE_FRAMES}
        out["encode"] = {t: vae.encode(pixels[t]).latent_dist.mean for t in ENCODE_FRAMES}
    return out


# Timeouts only catch hangs: generous, so that one shared core (taskset -c 0, 3 ranks) or a
# loaded machine does not fail a correct run.
@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_and_vae_parallel_equal_single_process(
    world, wan_inputs, wan_variant_inputs, tiny_i2v, vae_latents_of, vae_pixels_of
):
    """Ulysses (dense, boosted, sparse, I2V, TI2V; uneven sequence; 2 heads on 3 ranks), VAE,
    each rank's self-attention receiving only its share of the tokens."""
    data = {
        "grids": {grid: wan_inputs(grid, batch=2) for grid in GRIDS},
        "sparse": wan_inputs(SPARSE_GRID, batch=2),
        "i2v_config": tiny_i2v,
        **{v: wan_variant_inputs(v, grid=GRIDS[1]) for v in ("i2v", "ti2v")},
        "latents": {t: vae_latents_of(t) for t in DECODE_FRAMES},
        "pixels": {t: vae_pixels_of(t) for t in ENCODE_FRAMES},
    }
    results = launch(_ulysses_rank, world, data, timeout=900)
    blocks = build_tiny_transformer().config.num_layers
    for rank, res in enumerate(results):
        for grid in GRIDS:
            # Each rank's self-attention saw only its share of the tokens: ceil(S / world).
            tokens = grid[0] * grid[1] * grid[2]
            assert res[f"stock_tokens{grid}"] == [tokens] * blocks, (rank, grid, res)
            assert res[f"tokens{grid}"] == [-(-tokens // world)] * blocks, (rank, grid, res)
            assert res[f"dense{grid}"] < 1e-5, (rank, grid, res)
            assert res[f"boosted{grid}"] < 1e-5, (rank, grid, res)
        assert res["sparse"] < 1e-5, (rank, res)
        assert res["i2v"] < 1e-5 and res["ti2v"] < 1e-5, (rank, res)
        assert res["seed"] == 1000, "every rank must use rank 0's seed"
        assert res["vae_parallelized"] == ["model"]
        for frames, reference in res["vae_stock"].items():
            decoded = res["vae"][frames]
            assert decoded.shape == reference.shape, (rank, frames)
            assert torch.equal(decoded, reference), (rank, frames)
        for frames, reference in res["encode_stock"].items():
            assert torch.equal(res["encode"][frames], reference), (rank, frames)
    refusal = results[0]["refusal"]
    if world == 3:
        assert refusal is not None and "ulysses_degree=3" in refusal and "[1]" in refusal
    else:
        assert refusal is None


def test_vae_parallel_on_one_rank_is_a_no_op():
    """World size 1: ParallelManager leaves the VAE alone (stock decode)."""
    vae = build_tiny_vae()
    with liteboost.ParallelManager(vae, vae_parallel=True) as manager:
        assert manager.parallelized == []
        assert "decode" not in vae.__dict__ and "encode" not in vae.__dict__
