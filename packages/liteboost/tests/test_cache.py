"""Step caching through diffusers' hooks (BoostManager(cache=...)) and boosting twice.

Multi-rank composition (CFG, Ulysses, Ring) is in test_hybrid_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    HookRegistry,
    TaylorSeerCacheConfig,
)

import liteboost
from liteboost.cache import (
    BranchStates,
    GroupFirstBlockHook,
    cache_config,
    composes_with_sequence_parallel,
)
from liteboost.tiny import build_tiny_pipeline, build_tiny_transformer

CALL = dict(
    prompt="a red kite",
    negative_prompt="blurry",
    height=64,
    width=64,
    num_frames=5,
    num_inference_steps=6,
    guidance_scale=5.0,
    output_type="latent",
)


@torch.no_grad()
def _latents(pipe) -> torch.Tensor:
    return pipe(**CALL, generator=torch.Generator().manual_seed(0)).frames


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_pipeline()


@pytest.fixture(scope="module")
def uncached(pipe):
    return _latents(pipe)


def _ffn_calls(pipe, run) -> int:
    """Forwards of the last block's FFN during ``run()``: skipped blocks do not run it."""
    calls = []
    handle = pipe.transformer.blocks[-1].ffn.register_forward_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("sparse", [False, True])
def test_first_block_cache_skips_steps_and_stays_close(pipe, uncached, sparse):
    """Threshold 0.3 skips steps; the final latent moves little; remove() restores stock."""
    boost = dict(sparsity=0.5, block_size=16, sparse_kernel="reference") if sparse else {}
    reference = uncached
    if sparse:
        with liteboost.BoostManager(pipe, **boost):
            reference = _latents(pipe)
    with liteboost.BoostManager(pipe, cache="first_block", cache_threshold=0.3, **boost):
        head, second = (
            HookRegistry.check_if_exists_or_initialize(b) for b in pipe.transformer.blocks[:2]
        )
        group_hook = head.get_hook("fbc_leader_block_hook")
        assert isinstance(group_hook, GroupFirstBlockHook), "the decision is not group-wide"
        assert group_hook.state_manager is second.get_hook("fbc_block_hook").state_manager
        box = []
        calls = _ffn_calls(pipe, lambda: box.append(_latents(pipe)))
    cached = box[0]
    assert calls < 2 * CALL["num_inference_steps"], "nothing was cached"
    rel = ((cached - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.1, rel
    assert torch.equal(_latents(pipe), uncached), "remove() must restore the stock pipeline"


def test_cache_config_objects_and_names(pipe, uncached):
    """A diffusers config is used as given; a threshold of 0 never skips (equals uncached)."""
    with liteboost.BoostManager(pipe):
        boosted = _latents(pipe)
    with liteboost.BoostManager(pipe, cache=FirstBlockCacheConfig(threshold=0.0)):
        assert torch.equal(_latents(pipe), boosted)
    with liteboost.BoostManager(pipe, cache="taylorseer") as manager:
        assert isinstance(manager.cache, TaylorSeerCacheConfig)
        hooked = [
            name
            for name, module in pipe.transformer.named_modules()
            if "taylorseer_cache" in getattr(getattr(module, "_diffusers_hook", None), "hooks", {})
        ]
        assert hooked == [f"blocks.{i}" for i in range(len(pipe.transformer.blocks))]
        assert not torch.equal(_latents(pipe), uncached), "TaylorSeer predicted nothing"


def _last_attn1_per_call(pipe, run) -> tuple[list[torch.Tensor], list[bool], list[float]]:
    """Per transformer call: the last block's self-attention output, whether it computed
    (its query projection ran) and the pipeline's timestep."""
    outputs: list[torch.Tensor] = []
    computed: list[bool] = []
    timesteps: list[float] = []
    attn = pipe.transformer.blocks[-1].attn1

    def start(*_):
        computed.append(False)
        timesteps.append(float(pipe.current_timestep))

    def ran(*_):
        computed[-1] = True

    handles = [
        pipe.transformer.register_forward_pre_hook(start),
        attn.to_q.register_forward_hook(ran),
        attn.register_forward_hook(lambda _m, _a, out: outputs.append(out.clone())),
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return outputs, computed, timesteps


def test_pab_broadcasts_self_attention_every_other_call_inside_its_range(pipe, uncached):
    """cache="pab": inside timesteps (100, 800) every other call reuses the previous
    self-attention output instead of computing; elsewhere it computes as uncached."""
    with liteboost.BoostManager(pipe):
        reference, ref_computed, timesteps = _last_attn1_per_call(pipe, lambda: _latents(pipe))
    box = []
    with liteboost.BoostManager(pipe, cache="pab"):
        outputs, computed, _ = _last_attn1_per_call(pipe, lambda: box.append(_latents(pipe)))
    calls = 2 * CALL["num_inference_steps"]  # CFG: one call per branch per step
    assert len(timesteps) == len(outputs) == calls and all(ref_computed)
    # The documented schedule, from the timesteps the pipeline really used.
    expected = [i % 2 == 0 or not 100 < t < 800 for i, t in enumerate(timesteps)]
    assert not all(expected), f"no call of {timesteps} falls in PAB's range"
    assert computed == expected
    first_reuse = expected.index(False)
    for i in range(first_reuse):  # nothing reused yet: identical to the uncached run
        torch.testing.assert_close(outputs[i], reference[i], atol=0, rtol=0)
    for i in range(calls):
        if not expected[i]:
            assert torch.equal(outputs[i], outputs[i - 1]), f"call {i} did not reuse"
    assert not torch.allclose(outputs[first_reuse], reference[first_reuse], atol=1e-6)
    assert not torch.equal(box[0], uncached), "broadcasting changed nothing"
    assert torch.equal(_latents(pipe), uncached), "remove() must restore the stock pipeline"


def _attn1_outputs(pipe, run) -> tuple[list[torch.Tensor], int]:
    """Block 0's self-attention outputs per transformer call, and how often it computed."""
    outputs: list[torch.Tensor] = []
    computed = []
    attn = pipe.transformer.blocks[0].attn1
    handles = [
        attn.register_forward_hook(lambda _m, _a, out: outputs.append(out.clone())),
        attn.to_q.register_forward_hook(lambda *_: computed.append(1)),
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return outputs, len(computed)


def test_faster_cache_reuses_each_branchs_own_attention(pipe, uncached):
    """cache="faster": a skipped self-attention is extrapolated from the same branch's last two.

    6 steps at timesteps 999 ... 376; FasterCache may skip below 681 on odd iterations: only
    step 5 (376) of each branch. Steps 0-4 run as uncached, so the skipped outputs must be
    out4 + 0.5 * (out4 - out3) of the *same* branch (the pipeline alternates cond, uncond;
    diffusers' one state per hook would extrapolate across the branches).
    """
    with liteboost.BoostManager(pipe):
        reference, ref_computed = _attn1_outputs(pipe, lambda: _latents(pipe))
    box = []
    with liteboost.BoostManager(pipe, cache="faster") as manager:
        assert isinstance(manager.cache, FasterCacheConfig)
        outputs, computed = _attn1_outputs(pipe, lambda: box.append(_latents(pipe)))
    steps = CALL["num_inference_steps"]
    assert ref_computed == len(reference) == len(outputs) == 2 * steps
    assert computed == 2 * steps - 2, computed
    for call in range(2 * steps - 2):
        torch.testing.assert_close(outputs[call], reference[call], atol=1e-5, rtol=1e-5)
    for branch in (0, 1):  # 0 = cond, 1 = uncond
        last, before = reference[2 * (steps - 2) + branch], reference[2 * (steps - 3) + branch]
        expected = last + 0.5 * (last - before)
        got = outputs[2 * (steps - 1) + branch]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"branch {branch}")
    rel = ((box[0] - uncached).norm() / uncached.norm()).item()
    assert 0 < rel < 0.1, rel
    assert torch.equal(_latents(pipe), uncached), "remove() must restore the stock pipeline"


def test_branch_states_keep_one_state_per_cache_context_and_reset_all():
    """What a FasterCache hook writes under "cond" is not seen under "uncond" nor outside a
    context; reset() (diffusers resets stateful hooks after each pipeline call) clears all."""
    from diffusers.hooks.faster_cache import FasterCacheBlockState
    from diffusers.hooks.hooks import CacheContext, StateManager

    manager = StateManager(FasterCacheBlockState)
    state = BranchStates(manager, FasterCacheBlockState())
    for name, iteration in [("cond", 3), ("uncond", 5), (None, 7)]:
        manager.set_context(None if name is None else CacheContext(name))
        assert state.iteration == 0, f"{name} saw another branch's state"
        state.iteration += iteration
    for name, iteration in [("cond", 3), ("uncond", 5), (None, 7)]:
        manager.set_context(None if name is None else CacheContext(name))
        assert state.iteration == iteration, name
    state.reset()
    for name in ("cond", "uncond", None):
        manager.set_context(None if name is None else CacheContext(name))
        assert state.iteration == 0 and state.cache is None, name


def test_faster_cache_unconditional_shortcut_is_refused():
    """The batched-CFG shortcut cannot run on Wan's per-branch calls: refused, nothing left."""
    pipe = build_tiny_pipeline()
    config = FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep)
    with pytest.raises(ValueError, match=r"is_guidance_distilled=False.*once per branch"):
        liteboost.BoostManager(pipe, cache=config)
    assert "_liteboost_boost_owner" not in pipe.transformer.__dict__
    with pytest.raises(ValueError, match="cache='faster' reads the pipeline's current timestep"):
        liteboost.BoostManager(build_tiny_transformer(), cache="faster")


def test_cache_errors_name_the_argument():
    model = build_tiny_transformer()
    with pytest.raises(ValueError, match="cache='bogus'; use one of first_block, pab"):
        liteboost.BoostManager(model, cache="bogus")
    with pytest.raises(ValueError, match="cache='pab' reads the pipeline's current timestep"):
        liteboost.BoostManager(model, cache="pab")
    with pytest.raises(ValueError, match="cache_threshold applies to cache='first_block'"):
        cache_config("taylorseer", threshold=0.1)
    with pytest.raises(ValueError, match="MagCacheConfig"):
        cache_config("mag")
    assert "_liteboost_boost_owner" not in model.__dict__, "a refused boost leaves nothing behind"


def test_which_caches_compose_with_sequence_parallelism():
    from diffusers.hooks import MagCacheConfig, SeaCacheConfig

    assert composes_with_sequence_parallel(FirstBlockCacheConfig())
    assert composes_with_sequence_parallel(TaylorSeerCacheConfig())
    assert composes_with_sequence_parallel(FasterCacheConfig(is_guidance_distilled=True))
    assert composes_with_sequence_parallel(
        MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4)
    )
    assert not composes_with_sequence_parallel(SeaCacheConfig())


def test_boosting_a_boosted_pipeline_says_so(pipe, uncached):
    """The second BoostManager is refused with a clear message and changes nothing."""
    with liteboost.BoostManager(pipe, cache="first_block"):
        with pytest.raises(
            ValueError, match=r"transformer \(WanTransformer3DModel\) is already boosted"
        ):
            liteboost.BoostManager(pipe, sparsity=0.5)
        with pytest.raises(ValueError, match="call remove\\(\\) on that one"):
            liteboost.BoostManager(pipe.transformer)
    with liteboost.BoostManager(pipe):  # after remove() boosting works again
        assert torch.allclose(_latents(pipe), uncached, rtol=0, atol=1e-3)
    assert torch.equal(_latents(pipe), uncached)
