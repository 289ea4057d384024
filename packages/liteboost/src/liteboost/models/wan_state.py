"""liteboost's attachments to a WanTransformer3DModel, shared by its boost and parallel plans.

The boost plan (:mod:`liteboost.models.wan`), the parallel plan (:mod:`liteboost.parallel.wan`)
and the step caches (:mod:`liteboost.cache`) all reach one :class:`WanTransformerState` per model
through this module: the boosted attention processors and the grid hook are installed by the first
plan that attaches and removed by the last that detaches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from liteboost.attention.context import ForwardContext
from liteboost.attention.processor import AttentionSettings, BoostedWanAttnProcessor

_STATE_ATTR = "_liteboost_state"


class GridHook(ModelHook):
    """Records the post-patch token grid of each transformer forward in the shared context."""

    def __init__(self, context: ForwardContext, patch_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.context, self.patch_size = context, tuple(patch_size)
        self.world = 1
        # Set by the parallel plan: decides this forward's token order and shard alignment.
        self.on_grid: Callable[[ForwardContext, torch.device], None] | None = None

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.patch_size
        self.context.set_grid((frames // pt, height // ph, width // pw), self.world)
        if self.on_grid is not None:
            self.on_grid(self.context, hidden_states.device)
        return args, kwargs


@dataclass
class WanTransformerState:
    """liteboost's attachments to one WanTransformer3DModel, shared by boost and parallel plans."""

    context: ForwardContext = field(default_factory=ForwardContext)
    settings: AttentionSettings = field(default_factory=AttentionSettings)
    original_processors: dict[str, Any] | None = None
    users: set[str] = field(default_factory=set)


def find_transformer_state(model: Any) -> WanTransformerState | None:
    """The model's liteboost state, None when no plan is attached to it."""
    state = getattr(model, _STATE_ATTR, None)
    return state if isinstance(state, WanTransformerState) else None


def transformer_state(model: Any) -> WanTransformerState:
    """The model's liteboost state, created on first use."""
    state = find_transformer_state(model)
    if state is None:
        state = WanTransformerState()
        setattr(model, _STATE_ATTR, state)
    return state


def attach(model: Any, user: str) -> WanTransformerState:
    """Install the boosted processors and the grid hook (once per model), register ``user``."""
    state = transformer_state(model)
    if not state.users:
        state.original_processors = dict(model.attn_processors)
        processor = BoostedWanAttnProcessor(state.settings, state.context)
        model.set_attn_processor(processor)
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(GridHook(state.context, model.config.patch_size), "liteboost.grid")
    state.users.add(user)
    return state


def grid_hook(model: torch.nn.Module) -> GridHook:
    """The transformer's grid hook, installed by :func:`attach`."""
    hook = HookRegistry.check_if_exists_or_initialize(model).get_hook("liteboost.grid")
    if not isinstance(hook, GridHook):
        raise RuntimeError(f"{type(model).__name__} has no liteboost grid hook (not attached)")
    return hook


def detach(model: Any, user: str) -> None:
    """Unregister ``user``; the last one out restores the stock processors and hooks."""
    state = transformer_state(model)
    state.users.discard(user)
    if not state.users:
        model.set_attn_processor(state.original_processors)
        HookRegistry.check_if_exists_or_initialize(model).remove_hook(
            "liteboost.grid", recurse=False
        )
        delattr(model, _STATE_ATTR)
