"""Step caching through diffusers' own cache hooks, made to compose with liteboost's parallelism.

diffusers ships the caches (``diffusers.hooks``: first-block cache, Pyramid Attention Broadcast,
TaylorSeer, MagCache, ...) and attaches them with ``CacheMixin.enable_cache``; liteboost does not
reimplement any of them. What composing needs:

- Sparse attention and the boosted processor: nothing. The caches hook blocks or attention
  modules and either run them (our processor inside) or reuse an earlier output.
- CFG parallel: each rank runs one branch; the caches keep one state per ``cache_context`` name,
  so a rank's "cond" state evolves exactly as in a single process.
- Ulysses and Ring: every rank holds a shard of the tokens. Caches that decide by step count or
  timestep (PAB, TaylorSeer, MagCache with calibrated ratios) make the same decision on every
  rank. First-block cache decides from the data: the relative L1 change of the first block's
  residual. On a shard that is a different number on every rank, and ranks that disagree would
  deadlock in the next all-to-all. So liteboost replaces that one decision, per hook instance,
  by the same ratio over the whole sequence: sums of ``|r - r_prev|`` and ``|r_prev|`` over the
  rank's real tokens (padding excluded), all-reduced over the sequence-parallel group.
  Caches that decide from data in ways liteboost has not made group-wide (SeaCache, MagCache
  calibration) are refused under sequence parallelism instead of deadlocking.
- FasterCache: diffusers' hooks keep one state per hook, not per ``cache_context``, and its
  unconditional-branch shortcut splits a batch that holds both branches. diffusers' Wan pipelines
  run the branches as two batch-1 calls, where that shortcut fails (IndexError in diffusers'
  ``faster_cache.py``) and the attention reuse mixes the branches (the cached "previous" output
  of the cond call is the uncond call's). liteboost gives every FasterCache hook one state per
  ``cache_context`` name, so each branch reuses its own attention outputs, and accepts only
  ``is_guidance_distilled=True`` (attention reuse, no unconditional shortcut). Under CFG
  parallel the unconditional branch runs at the same time as the conditional one on the other
  rank, so approximating it would save no time anyway, only add error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from diffusers.hooks.hooks import BaseState, StateManager

from liteboost.models.wan_state import find_transformer_state, transformer_state

if TYPE_CHECKING:
    from liteboost.parallel.sequence import SequenceParallel


class _TimestepSource(Protocol):
    """What the timestep-driven caches read: a diffusers pipeline's ``current_timestep``."""

    @property
    def current_timestep(self) -> Any: ...


_FBC_HEAD_HOOK = "fbc_leader_block_hook"
CACHE_NAMES = ("first_block", "pab", "taylorseer", "faster", "mag")
_FASTER_HOOKS = ("faster_cache_denoiser", "faster_cache_block")


def cache_config(
    cache: object, pipeline: object | None = None, threshold: float | None = None
) -> Any:
    """A diffusers cache config from a config object or a short name.

    Args:
        cache: a diffusers cache config (``FirstBlockCacheConfig(...)``, ...) used as given, or
            one of ``CACHE_NAMES``: "first_block" (``FirstBlockCacheConfig``), "pab"
            (``PyramidAttentionBroadcastConfig`` on self-attention, every other step between
            timesteps 100 and 800), "taylorseer" (``TaylorSeerCacheConfig`` defaults on every
            transformer block).
            "mag" needs calibrated ratios, so only a ``MagCacheConfig`` object is accepted.
        pipeline: the pipeline, for caches that read the current timestep.
        threshold: first-block cache threshold (default diffusers' 0.05).

    Raises:
        ValueError: an unknown name, or a timestep-driven cache without a pipeline (an object
            whose class has ``current_timestep``).
    """
    from diffusers.hooks import (
        FirstBlockCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    if not isinstance(cache, str):
        if threshold is not None:
            raise ValueError("cache_threshold applies to cache='first_block' only")
        return cache
    if cache == "first_block":
        return FirstBlockCacheConfig(threshold=0.05 if threshold is None else threshold)
    if threshold is not None:
        raise ValueError(f"cache_threshold applies to cache='first_block', not {cache!r}")
    # Checked on the class: diffusers' pipelines set the property's value only inside __call__.
    timesteps = (
        cast(_TimestepSource, pipeline) if hasattr(type(pipeline), "current_timestep") else None
    )
    if cache == "pab":
        if timesteps is None:
            raise ValueError(
                "cache='pab' reads the pipeline's current timestep: pass the pipeline, or a "
                "PyramidAttentionBroadcastConfig with current_timestep_callback"
            )
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(100, 800),
            current_timestep_callback=lambda: timesteps.current_timestep,
        )
    if cache == "taylorseer":
        # diffusers' default patterns ("^blocks.*attn", matched whole) miss Wan's "attn1"/"attn2",
        # so name the blocks: their outputs are predicted from the Taylor factors.
        return TaylorSeerCacheConfig(cache_identifiers=[r"blocks\.\d+"])
    if cache == "faster":
        if timesteps is None:
            raise ValueError(
                "cache='faster' reads the pipeline's current timestep: pass the pipeline, or a "
                "FasterCacheConfig with current_timestep_callback"
            )
        from diffusers.hooks import FasterCacheConfig

        return FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 681),
            current_timestep_callback=lambda: timesteps.current_timestep,
            attention_weight_callback=lambda _module: 0.5,
            is_guidance_distilled=True,
            tensor_format="BCFHW",
        )
    if cache == "mag":
        raise ValueError(
            "cache='mag' needs the model's calibrated magnitude ratios: pass "
            "diffusers.hooks.MagCacheConfig(mag_ratios=..., num_inference_steps=...)"
        )
    raise ValueError(
        f"cache={cache!r}; use one of {', '.join(CACHE_NAMES[:4])} or a diffusers cache config"
    )


def composes_with_sequence_parallel(config: object) -> bool:
    """Whether every rank of a sequence-parallel group makes the same caching decisions."""
    name = type(config).__name__
    if name == "MagCacheConfig":
        return not getattr(config, "calibrate", False)
    return name in {
        "FasterCacheConfig",
        "FirstBlockCacheConfig",
        "PyramidAttentionBroadcastConfig",
        "TaylorSeerCacheConfig",
        "TextKVCacheConfig",
    }


def sequence_parallel_of(model: torch.nn.Module) -> SequenceParallel | None:
    """The model's liteboost sequence-parallel exchange, None when it runs on one rank."""
    from liteboost.parallel.sequence import SequenceParallel

    state = find_transformer_state(model)
    sp = state.settings.ulysses if state is not None else None
    return sp if isinstance(sp, SequenceParallel) else None


def check_composes(model: torch.nn.Module, config: object | None) -> None:
    """Refuse a cache whose decisions would differ between sequence-parallel ranks."""
    if config is None or sequence_parallel_of(model) is None:
        return
    if not composes_with_sequence_parallel(config):
        raise ValueError(
            f"{type(config).__name__} decides from data each rank holds only a shard of, and "
            "liteboost does not make that decision group-wide: with Ulysses or Ring use "
            "FirstBlockCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig or "
            "MagCacheConfig with calibrated ratios"
        )


def _group_wide_first_block_decision(
    hook: Any, model: torch.nn.Module
) -> Callable[[torch.Tensor], bool]:
    """Replacement for ``FBCHeadBlockHook._should_compute_remaining_blocks`` (see module doc)."""
    single = hook._should_compute_remaining_blocks

    @torch.compiler.disable
    def should_compute(residual: torch.Tensor) -> bool:
        sp = sequence_parallel_of(model)
        if sp is None:
            return single(residual)
        state = hook.state_manager.get_state()
        previous = state.head_block_residual
        if previous is None:
            return True
        context = transformer_state(model).context
        real = min(max(context.seq_len - sp.rank * context.shard_len, 0), residual.shape[1])
        sums = torch.stack(
            [
                (residual[:, :real] - previous[:, :real]).abs().sum(),
                previous[:, :real].abs().sum(),
            ]
        ).double()
        dist.all_reduce(sums, group=sp.group)
        return (sums[0] / sums[1]).item() > hook.threshold

    return should_compute


class _ContextOnly(BaseState):
    """A state that holds nothing: its StateManager only receives the ``cache_context``."""

    def reset(self, *args: object, **kwargs: object) -> None:
        pass


def _branch_state(hook: Any) -> Any:
    """The hook's state for the current ``cache_context`` name (None outside a context)."""
    try:
        name = hook.state_manager.context.name
    except ValueError:  # a direct call, outside cache_context
        name = None
    states = hook.__dict__.setdefault("_liteboost_branch_states", {})
    if name not in states:
        states[name] = hook._liteboost_state_cls()
    return states[name]


def _reset_branch_states(hook: Any, module: torch.nn.Module) -> torch.nn.Module:
    hook.__dict__.get("_liteboost_branch_states", {}).clear()
    return module


_PER_BRANCH: dict[type, type] = {}


def _faster_cache_per_branch(model: torch.nn.Module) -> None:
    """Give every FasterCache hook under ``model`` one state per ``cache_context`` name.

    The hook's class becomes a subclass whose ``state`` reads the current branch's state; a
    ``StateManager`` attribute makes diffusers hand the hook the context. ``disable_cache``
    removes the hooks as usual.
    """
    from diffusers.hooks import HookRegistry

    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in _FASTER_HOOKS:
            hook = registry.get_hook(name)
            if hook is None or type(hook) in _PER_BRANCH.values():
                continue
            cls = type(hook)
            if cls not in _PER_BRANCH:
                _PER_BRANCH[cls] = type(
                    f"PerBranch{cls.__name__}",
                    (cls,),
                    {"state": property(_branch_state), "reset_state": _reset_branch_states},
                )
            hook._liteboost_state_cls = type(hook.__dict__.pop("state"))
            # diffusers annotates state_cls as a BaseState instance; it is the class it builds.
            hook.state_manager = StateManager(_ContextOnly)  # type: ignore[arg-type]
            hook.__class__ = _PER_BRANCH[cls]
    HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()


@dataclass
class CacheHandle:
    """Undoes :func:`apply_cache`."""

    model: Any
    config: Any

    def remove(self) -> None:
        if getattr(self.model, "_liteboost_cache", None) is self.config:
            del self.model._liteboost_cache
        self.model.disable_cache()


def apply_cache(model: torch.nn.Module, config: object) -> CacheHandle:
    """``model.enable_cache(config)`` plus the group-wide first-block decision.

    Raises:
        TypeError: the model has no ``enable_cache`` (not a diffusers CacheMixin model).
        ValueError: the cache does not compose with the model's sequence parallelism.
    """
    from diffusers.models.cache_utils import CacheMixin

    if not isinstance(model, CacheMixin):
        raise TypeError(f"{type(model).__name__} has no diffusers cache support (enable_cache)")
    check_composes(model, config)
    faster = type(config).__name__ == "FasterCacheConfig"
    if faster and not getattr(config, "is_guidance_distilled", False):
        raise ValueError(
            "FasterCacheConfig(is_guidance_distilled=False): its unconditional-branch shortcut "
            "needs one call holding both CFG branches, but diffusers' Wan pipelines call the "
            "transformer once per branch (batch 1; diffusers' hook fails there), and under CFG "
            "parallel the unconditional branch already runs alongside the conditional one; use "
            "is_guidance_distilled=True (per-branch attention reuse) or cache='faster'"
        )
    model.enable_cache(config)
    if faster:
        _faster_cache_per_branch(model)
    if type(config).__name__ == "FirstBlockCacheConfig":
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.first_block_cache import FBCHeadBlockHook

        blocks = model.blocks
        assert isinstance(blocks, torch.nn.ModuleList), type(blocks)
        for block in blocks[:1]:
            hook = HookRegistry.check_if_exists_or_initialize(block).get_hook(_FBC_HEAD_HOOK)
            if isinstance(hook, FBCHeadBlockHook):
                # An instance attribute shadows the method for this hook only.
                decide = _group_wide_first_block_decision(hook, model)
                hook._should_compute_remaining_blocks = decide
    # nn.Module types attribute assignment as Tensor | Module; any value is stored as given.
    model._liteboost_cache = config  # type: ignore[assignment]
    return CacheHandle(model, config)
