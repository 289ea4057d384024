"""Block-sparse ring attention inside the Wan plan, on real gloo ranks.

With a ring and sparsity > 0 the Wan plan cuts the tokens in tile order (tokens, RoPE rows and
TI2V's per-token modulation permuted after the patch embedding, raster order restored before
``norm_out``) and runs ``RingAttention.sparse``. The independent reference is the 1-process run
of the same boosted transformer (same sparsity, block size, kept blocks chosen from the whole
sequence), computed in the same rank; the dense output shows the sparsity is really applied.
"""

from __future__ import annotations

import pytest
import torch

import liteboost
from liteboost.tiny import build_tiny_transformer
from npu_core.dist import launch


@torch.no_grad()
def _rank(cases: dict, layouts: list[tuple[int, int]]) -> dict:
    model = build_tiny_transformer()
    out: dict = {}
    for name, (inputs, boost) in cases.items():
        dense = model(**inputs).sample
        with liteboost.BoostManager(model, **boost):
            single = model(**inputs).sample
            for ulysses, ring in layouts:
                with liteboost.ParallelManager(
                    model, ulysses_degree=ulysses, ring_degree=ring, vae_parallel=False
                ):
                    parallel = model(**inputs).sample
                out[name, ulysses, ring] = (parallel - single).abs().max().item()
        out[name, "sparse vs dense"] = (single - dense).abs().max().item()
        out[name, "restored"] = (model(**inputs).sample - dense).abs().max().item()
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 4])
def test_sparse_ring_in_the_wan_plan_equals_the_single_process(
    world, wan_inputs, wan_variant_inputs
):
    """ring 2 (2 ranks), Ulysses 2 x ring 2 and ring 4 (4 ranks) == 1-process sparse output."""
    cases = {
        # 192 tokens in blocks of 16, cached RoPE tables (RopeTables rows permuted)
        "even": (wan_inputs((3, 8, 8), batch=2), dict(sparsity=0.5, block_size=16)),
        # 70 tokens: a partial last tile and end padding; diffusers' own RoPE (cos, sin) tuple
        "uneven": (
            wan_inputs((2, 5, 7)),
            dict(sparsity=0.75, block_size=16, rope_cache=False, sparse_kernel="reference"),
        ),
        # Wan2.2 TI2V: one modulation per token, permuted with the tokens
        "ti2v": (wan_variant_inputs("ti2v", grid=(2, 6, 6)), dict(sparsity=0.5, block_size=16)),
    }
    layouts = [(1, 2)] if world == 2 else [(2, 2), (1, 4)]
    results = launch(_rank, world, cases, layouts, timeout=800)
    for rank, res in enumerate(results):
        for name in cases:
            for ulysses, ring in layouts:
                assert res[name, ulysses, ring] < 1e-5, (rank, name, ulysses, ring, res)
            # The sparse output is not the dense one (else equality above would prove nothing)
            assert res[name, "sparse vs dense"] > 1e-3, (rank, name, res)
            assert res[name, "restored"] == 0.0, (rank, name, res)
