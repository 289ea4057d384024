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
  rank's real tokens (padding excluded), all-reduced over the sequence-parallel group. It does
  so through diffusers' public hook API: the first block's cache hook is replaced, under the
  same hook name, by :class:`GroupFirstBlockHook` (a ``FBCHeadBlockHook`` sharing the cache's
  state) whose forward is diffusers' own on one rank.
  Caches that decide from data in ways liteboost has not made group-wide (SeaCache, MagCache
  calibration) are refused under sequence parallelism instead of deadlocking.
- FasterCache: diffusers' hooks keep one state per hook, not per ``cache_context``, and its
  unconditional-branch shortcut splits a batch that holds both branches. diffusers' Wan pipelines
  run the branches as two batch-1 calls, where that shortcut fails (IndexError in diffusers'
  ``faster_cache.py``) and the attention reuse mixes the branches (the cached "previous" output
  of the cond call is the uncond call's). liteboost gives every FasterCache hook one state per
  ``cache_context`` name (:class:`BranchStates` stands in for the hook's public ``state``, and
  a ``StateManager`` attribute lets diffusers hand the hook the context), so each branch reuses
  its own attention outputs, and accepts only
  ``is_guidance_distilled=True`` (attention reuse, no unconditional shortcut). Under CFG
  parallel the unconditional branch runs at the same time as the conditional one on the other
  rank, so approximating it would save no time anyway, only add error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from diffusers.hooks.faster_cache import FasterCacheBlockHook, FasterCacheDenoiserHook
from diffusers.hooks.first_block_cache import FBCHeadBlockHook
from diffusers.hooks.hooks import StateManager
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention

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
# The module types FasterCache attaches its block hooks to (diffusers' public classes).
_ATTENTION_CLASSES = (Attention, AttentionModuleMixin)


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


class GroupFirstBlockHook(FBCHeadBlockHook):
    """First-block cache's head hook whose skip decision is the same on every sequence rank.

    On one rank it is diffusers' ``FBCHeadBlockHook``. Under Ulysses or Ring it computes the
    relative change of the first block's residual over the whole sequence (see the module
    docstring) and applies it as diffusers does to a block returning one tensor (Wan's).

    Args:
        state_manager: the first-block cache's shared state (that of the hook it replaces).
        threshold: relative change above which the remaining blocks run.
        model: the transformer, whose sequence parallelism is looked up on each call.
    """

    def __init__(self, state_manager: StateManager, threshold: float, model: torch.nn.Module):
        super().__init__(state_manager, threshold)
        self.model = model

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        sp = sequence_parallel_of(self.model)
        if sp is None:
            return super().new_forward(module, *args, **kwargs)
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        forward = self.fn_ref.original_forward
        if forward is None:  # set by HookRegistry.register_hook for a hook with new_forward
            raise RuntimeError("GroupFirstBlockHook called before it was registered")
        output = forward(*args, **kwargs)
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"{type(module).__name__} returns {type(output).__name__}: liteboost's "
                "group-wide first-block cache supports blocks returning one tensor (Wan's)"
            )
        residual = output - hidden_states
        state = self.state_manager.get_state()
        previous = state.head_block_residual
        state.should_compute = previous is None or self.group_change(sp, residual, previous)
        if not state.should_compute:
            return state.tail_block_residuals[0] + output
        state.head_block_output, state.head_block_residual = output, residual
        return output

    @torch.compiler.disable
    def group_change(
        self, sp: SequenceParallel, residual: torch.Tensor, previous: torch.Tensor
    ) -> bool:
        """Whether the residual's relative L1 change over the whole sequence exceeds the
        threshold (the same answer on every rank of ``sp``)."""
        context = transformer_state(self.model).context
        real = min(max(context.seq_len - sp.rank * context.shard_len, 0), residual.shape[1])
        sums = torch.stack(
            [
                (residual[:, :real] - previous[:, :real]).abs().sum(),
                previous[:, :real].abs().sum(),
            ]
        ).double()
        dist.all_reduce(sums, group=sp.group)
        return bool((sums[0] / sums[1]).item() > self.threshold)


def _group_wide_first_block(model: torch.nn.Module) -> None:
    """Replace the first block's first-block-cache hook by :class:`GroupFirstBlockHook`.

    Right after ``enable_cache`` the head hook is the last one registered on its block, so the
    replacement, registered under the same name, takes its place in the hook order, and
    ``disable_cache`` removes it by that name.
    """
    blocks = model.blocks
    assert isinstance(blocks, torch.nn.ModuleList), type(blocks)
    registry = HookRegistry.check_if_exists_or_initialize(blocks[0])
    head = registry.get_hook(_FBC_HEAD_HOOK)
    if not isinstance(head, FBCHeadBlockHook) or isinstance(head, GroupFirstBlockHook):
        return
    registry.remove_hook(_FBC_HEAD_HOOK, recurse=False)
    registry.register_hook(
        GroupFirstBlockHook(head.state_manager, head.threshold, model), _FBC_HEAD_HOOK
    )


class BranchStates:
    """A FasterCache hook's ``state`` with one real state per ``cache_context`` name.

    The hook reads and writes ``state.iteration``, ``state.cache``, ...; each goes to the state
    of the current branch, kept by ``manager`` (diffusers' ``StateManager``, which receives the
    context). Calls outside any ``cache_context`` share one more state. ``reset()`` (diffusers
    resets stateful hooks after each pipeline call) resets every branch.

    Args:
        manager: the per-context states, created from the hook's own state class.
        outside: the state for calls outside a ``cache_context``.
    """

    def __init__(self, manager: StateManager, outside: Any) -> None:
        object.__setattr__(self, "manager", manager)
        object.__setattr__(self, "outside", outside)

    def current(self) -> Any:
        """The current branch's state."""
        try:
            return self.manager.get_state()
        except ValueError:  # diffusers' StateManager outside a cache_context
            return self.outside

    def reset(self) -> None:
        self.manager.reset()
        self.outside.reset()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.current(), name, value)


def _faster_cache_per_branch(model: torch.nn.Module) -> None:
    """Give every FasterCache hook under ``model`` one state per ``cache_context`` name.

    FasterCache registers its hooks on the model and on attention modules, so those are the
    modules looked at (through ``HookRegistry``'s public API, which gives a module without hooks
    an empty registry). ``disable_cache`` removes the hooks as usual.
    """
    modules = [model, *(m for m in model.modules() if isinstance(m, _ATTENTION_CLASSES))]
    for module in modules:
        registry = HookRegistry.check_if_exists_or_initialize(module)
        for name in _FASTER_HOOKS:
            hook = registry.get_hook(name)
            if not isinstance(hook, (FasterCacheBlockHook, FasterCacheDenoiserHook)):
                continue
            if isinstance(hook.state, BranchStates):
                continue
            # diffusers annotates state_cls as a BaseState instance; it is the class it builds.
            manager = StateManager(type(hook.state))  # type: ignore[arg-type]
            # Both are plain instance attributes; diffusers types ``state`` as its own class.
            attrs = cast(Any, hook)
            attrs.state_manager = manager
            attrs.state = BranchStates(manager, hook.state)
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
        _group_wide_first_block(model)
    # nn.Module types attribute assignment as Tensor | Module; any value is stored as given.
    model._liteboost_cache = config  # type: ignore[assignment]
    return CacheHandle(model, config)
