"""Hybrid CFG x Ring x Ulysses, spatial VAE decode and step caching on real gloo ranks.

Every layout is compared with the single-process result computed in the same rank (same thread
count). One launch per world size runs every check: rank start-up dominates here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import liteboost
from liteboost.parallel.config import resolve_degrees
from liteboost.parallel.vae_dp import choose_decode_mode
from liteboost.tiny import build_tiny_pipeline, build_tiny_transformer, build_tiny_vae
from npu_core.config import ConfigError
from npu_core.dist import launch
from packages.liteboost.tests.token_counts import forward_counting_tokens

# Tiny pipeline call: 2 latent frames of 8 x 16 -> 64 tokens after the 2x2 patch.
PIPE_CALL = dict(
    prompt="a red kite",
    negative_prompt="blurry",
    height=64,
    width=128,
    num_frames=5,
    num_inference_steps=6,
    guidance_scale=5.0,
    output_type="latent",
)
# First-block cache threshold at which the tiny random model skips some but not all steps.
FBC_THRESHOLD = 0.3
SPARSE = dict(sparsity=0.5, block_size=16, sparse_kernel="reference")
VAE_LATENTS = [(1, 4, 3, 12, 10), (2, 4, 2, 7, 5)]


def _run(pipe) -> torch.Tensor:
    return pipe(**PIPE_CALL, generator=torch.Generator().manual_seed(0)).frames


class _Count:
    """Forwards of the last block's FFN per CFG branch: it runs only when the first-block cache
    misses. The branch is the cache context diffusers hands the first-block cache's hook."""

    def __init__(self, pipe) -> None:
        self.calls: dict[str, int] = {}
        self.transformer = pipe.transformer
        ffn = pipe.transformer.blocks[-1].ffn
        self.handle = ffn.register_forward_hook(self._count)

    def _count(self, *_args) -> None:
        hook = self.transformer.blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
        name = hook.state_manager.context.name if hook is not None else "any"
        self.calls[name] = self.calls.get(name, 0) + 1


def _cached_run(pipe, boost: dict, layout: tuple[int, int, int] | None) -> tuple:
    counter = _Count(pipe)
    with liteboost.BoostManager(pipe, **boost):
        if layout is None:
            latents = _run(pipe)
        else:
            cfg, ulysses, ring = layout
            with liteboost.ParallelManager(
                pipe, cfg_degree=cfg, ulysses_degree=ulysses, ring_degree=ring, vae_parallel=False
            ):
                latents = _run(pipe)
    counter.handle.remove()
    return latents, counter.calls


@torch.no_grad()
def _hybrid_rank(transformer_cases: dict, layouts: list, pipe_layouts: list, cache_cases) -> dict:
    out: dict = {"transformer": {}, "tokens": {}, "pipeline": {}, "cache": {}, "vae": {}}
    model = build_tiny_transformer()
    for name, inputs in transformer_cases.items():
        stock, out["tokens"][name, 1, 1] = forward_counting_tokens(model, inputs)
        for ulysses, ring in layouts:
            with liteboost.ParallelManager(
                model, ulysses_degree=ulysses, ring_degree=ring, vae_parallel=False
            ):
                parallel, out["tokens"][name, ulysses, ring] = forward_counting_tokens(
                    model, inputs
                )
            out["transformer"][name, ulysses, ring] = (parallel - stock).abs().max().item()
        with liteboost.BoostManager(model):  # cached RoPE tables + the boosted processor
            boosted = model(**inputs).sample
            with liteboost.ParallelManager(
                model, ulysses_degree=1, ring_degree=dist.get_world_size(), vae_parallel=False
            ):
                both = model(**inputs).sample
        out["transformer"][name, "boosted ring"] = (both - boosted).abs().max().item()
    try:
        liteboost.ParallelManager(model, cfg_degree=2)
        out["cfg_bare"] = None
    except ValueError as exc:
        out["cfg_bare"] = str(exc)

    pipe = build_tiny_pipeline()
    reference = _run(pipe)
    for layout in pipe_layouts:
        cfg, ulysses, ring = layout
        with liteboost.ParallelManager(
            pipe, cfg_degree=cfg, ulysses_degree=ulysses, ring_degree=ring, vae_parallel=False
        ) as manager:
            latents = _run(pipe)
            hook = pipe.transformer._diffusers_hook.get_hook("liteboost.cfg")
            exchanges = hook.exchanges if hook is not None else 0
            out["mesh"] = manager.mesh.mesh_dim_names
        out["pipeline"][layout] = ((latents - reference).abs().max().item(), exchanges)

    for boost_name, layout in cache_cases:
        boost = {"cache": "first_block", "cache_threshold": FBC_THRESHOLD}
        if boost_name == "fbc+sparse":
            boost.update(SPARSE)
        elif boost_name in ("pab", "taylorseer", "faster"):
            boost = {"cache": boost_name}
        single, single_calls = _cached_run(pipe, boost, None)
        parallel, calls = _cached_run(pipe, boost, layout)
        out["cache"][boost_name, layout] = {
            "vs_single": (parallel - single).abs().max().item(),
            "calls": (calls, single_calls),
            "rel_error_vs_uncached": ((single - reference).norm() / reference.norm()).item(),
        }

    vae = build_tiny_vae()
    for shape in VAE_LATENTS:
        z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        stock = vae.decode(z).sample
        with liteboost.ParallelManager(vae):
            decoded = vae.decode(z).sample
        mode = choose_decode_mode(vae, z, dist.get_world_size())
        out["vae"][shape] = (
            (decoded - stock).abs().max().item(),
            mode,
            decoded.shape == stock.shape,
        )
    return out


def _check(results, transformer_keys, pipe_layouts, cache_cases, tokens) -> None:
    world = len(results)
    blocks = build_tiny_transformer().config.num_layers
    for rank, res in enumerate(results):
        # Sequence parallelism: each rank's self-attention saw ceil(S / (ulysses x ring)) tokens.
        for (name, ulysses, ring), seen in res["tokens"].items():
            share = -(-tokens[name] // (ulysses * ring))
            assert seen == [share] * blocks, (rank, name, ulysses, ring, seen)
        for key in transformer_keys:
            assert res["transformer"][key] < 1e-5, (rank, key, res["transformer"])
        for layout in pipe_layouts:
            diff, exchanges = res["pipeline"][layout]
            assert diff < 1e-4, (rank, layout, diff)
            # CFG parallel exchanges once per step, and only when it is on.
            assert exchanges == (PIPE_CALL["num_inference_steps"] if layout[0] == 2 else 0)
        for key in cache_cases:
            case = res["cache"][tuple(key)]
            assert case["vs_single"] < 1e-4, (rank, key, case)
            calls, single_calls = case["calls"]
            if key[0].startswith("fbc"):
                # Same decisions as the single process: the last block ran on the same steps of
                # each branch (CFG parallel: a rank runs only its own branch).
                expected = dict(single_calls)
                if key[1][0] == 2:
                    branch = "cond" if rank < world // 2 else "uncond"
                    expected = {branch: single_calls[branch]}
                assert calls == expected, (rank, key, case)
                computed = sum(single_calls.values())
                assert computed < 2 * PIPE_CALL["num_inference_steps"], "nothing was cached"
        assert res["cfg_bare"] is not None and "cfg_degree=2" in res["cfg_bare"]
        assert res["mesh"] == ("cfg", "ring", "ulysses")
        for shape, (diff, mode, same_shape) in res["vae"].items():
            # Spatial slabs: exact halo, float rounding of convolutions over other shapes.
            assert same_shape and diff < 1e-5, (rank, shape, diff)
            assert mode == "spatial", (shape, mode)


# Timeouts only catch hangs: start-up of 4 ranks on 2 loaded cores takes minutes.
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_layouts_equal_single_process(world, wan_inputs, wan_variant_inputs):
    """Ulysses, Ring, Ulysses x Ring, CFG x both, caches on them and spatial VAE == 1 process;
    each rank's self-attention receives only its share of the tokens."""
    cases = {
        "even": wan_inputs((3, 4, 4), batch=2),
        "uneven": wan_inputs((1, 5, 7), batch=2),  # 35 tokens: padding on 2 and 4 ranks
        "ti2v": wan_variant_inputs("ti2v", grid=(1, 5, 7)),
    }
    if world == 2:
        layouts = [(2, 1), (1, 2)]
        pipe_layouts = [(2, 1, 1), (1, 1, 2)]
        cache_cases = [
            ("fbc", (1, 2, 1)),
            ("fbc", (2, 1, 1)),
            ("fbc", (1, 1, 2)),
            ("faster", (2, 1, 1)),
        ]
    else:
        layouts = [(4, 1), (1, 4), (2, 2)]
        pipe_layouts = [(2, 2, 1), (2, 1, 2), (1, 2, 2)]
        cache_cases = [
            ("fbc+sparse", (2, 2, 1)),
            ("fbc", (2, 1, 2)),
            ("pab", (1, 2, 2)),
            ("taylorseer", (2, 2, 1)),
            ("faster", (1, 2, 2)),
        ]
    results = launch(_hybrid_rank, world, cases, layouts, pipe_layouts, cache_cases, timeout=900)
    keys = [(n, u, r) for n in cases for u, r in layouts] + [(n, "boosted ring") for n in cases]
    # tokens after the (1, 2, 2) patch embedding: frames x height / 2 x width / 2
    tokens = {n: math.prod(c["hidden_states"].shape[2:]) // 4 for n, c in cases.items()}
    _check(results, keys, pipe_layouts, cache_cases, tokens)


def test_degrees_must_multiply_to_the_world_size():
    """The error names every degree and the world size; None takes what is left."""
    assert resolve_degrees(8, 2, None, 2) == (2, 2, 2)
    assert resolve_degrees(4, 1, None, 1) == (1, 4, 1)
    with pytest.raises(
        ValueError,
        match=r"cfg_degree=2 x ulysses_degree=2 x ring_degree=2 = 8, but the world size is 4",
    ):
        resolve_degrees(4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"cfg_degree: .* less than or equal to 2 \(got 3\)"):
        resolve_degrees(6, 3, None, 1)
    with pytest.raises(ValueError, match=r"ring_degree: .* greater than or equal to 1 \(got 0\)"):
        resolve_degrees(2, 1, None, 0)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        resolve_degrees(4, 1, None, 3)


def test_parallel_manager_on_one_process_checks_degrees():
    """Without ranks every degree must be 1: asking for 2 says the product and the world size."""
    with pytest.raises(ValueError, match="world size 1"):
        liteboost.ParallelManager(build_tiny_transformer(), ring_degree=2)


BAD_SETTINGS = [
    ({"ulysses_degree": 0}, r"ulysses_degree: Input should be greater than or equal to 1"),
    ({"ring_degree": True}, r"ring_degree: a boolean is not a number"),
    ({"vae_mode": "diagonal"}, r"vae_mode: Input should be 'temporal' or 'spatial'"),
    ({"vae_receptive_field": -1}, r"vae_receptive_field: Input should be greater than or equal"),
    ({"pad_heads": "maybe"}, r"pad_heads: Input should be a valid boolean"),
]


@pytest.mark.parametrize(("settings", "match"), BAD_SETTINGS, ids=lambda x: str(x)[:30])
def test_parallel_manager_refuses_a_bad_setting_naming_field_and_value(settings, match):
    """Each bad argument is one ConfigError line (field, bound, the value given); the model is
    left as it was."""
    model = build_tiny_transformer()
    before = dict(model.attn_processors)
    with pytest.raises(ConfigError, match=match) as refused:
        liteboost.ParallelManager(model, **settings)
    assert f"(got {next(iter(settings.values()))!r})" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert dict(model.attn_processors) == before


def test_parallel_manager_keeps_the_resolved_settings_apart_from_the_groups():
    """One process: config is the validated settings, Ulysses resolved to the world size (1);
    the run-time state holds no mesh and no groups."""
    manager = liteboost.ParallelManager(build_tiny_vae(), vae_mode="spatial")
    assert isinstance(manager.config, liteboost.ParallelConfig)
    assert manager.config.ulysses_degree == 1 and manager.config.vae_mode == "spatial"
    assert manager.runtime.config is manager.config and manager.runtime.world_size == 1
    assert manager.mesh is None and manager.runtime.sp_group is None
