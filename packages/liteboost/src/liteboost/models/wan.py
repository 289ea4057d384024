"""Wan2.1 / Wan2.2 plans: boost and Ulysses for WanTransformer3DModel, VAE temporal DP.

Everything is attached through diffusers' extension points: processors through
``WanAttention.set_processor``, per-forward facts through ``diffusers.hooks.HookRegistry`` hooks
on the transformer, its ``rope`` module and its blocks. Every plan returns a handle whose
``remove()`` restores the stock model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from liteboost.attention.context import ForwardContext
from liteboost.attention.processor import AttentionSettings, BoostedWanAttnProcessor
from liteboost.models.registry import register_boost, register_parallel
from liteboost.ops import tiling
from liteboost.ops.rope import RopeTables, rope_tables
from liteboost.parallel import vae_dp
from liteboost.parallel.ulysses import TokenShards

if TYPE_CHECKING:
    from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    from liteboost.boost import BoostConfig
    from liteboost.parallel.manager import ParallelConfig
    from liteboost.parallel.wan import WanParallelHandle

# Wan builds WanRotaryPosEmbed with its default theta.
_WAN_ROPE_THETA = 10000.0
_STATE_ATTR = "_liteboost_state"


class _GridHook(ModelHook):
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


class _CachedRopeHook(ModelHook):
    """Replaces WanRotaryPosEmbed's per-forward table build by a cached lookup."""

    def __init__(self, context: ForwardContext, head_dim: int) -> None:
        super().__init__()
        self.context, self.head_dim = context, head_dim

    def new_forward(self, module: torch.nn.Module, hidden_states: torch.Tensor) -> RopeTables:
        grid = self.context.grid
        if grid is None:  # the grid hook runs first on every transformer forward
            raise RuntimeError("liteboost's RoPE cache ran before the transformer's grid hook")
        return rope_tables(self.head_dim, grid, theta=_WAN_ROPE_THETA, device=hidden_states.device)


def _reorder_rotary(rotary: Any, layout: tiling.TileLayout) -> Any:
    """RoPE rows in tile order (the tokens' order under block-sparse ring attention)."""
    if isinstance(rotary, RopeTables):
        return RopeTables(
            tiling.reorder(rotary[0], layout, seq_dim=1),
            tiling.reorder(rotary[1], layout, seq_dim=1),
            tiling.reorder(rotary.pair_cos, layout, seq_dim=0),
            tiling.reorder(rotary.pair_sin, layout, seq_dim=0),
        )
    return tuple(tiling.reorder(t, layout, seq_dim=1) for t in rotary)


def _pad_rotary(rotary: Any, total: int) -> Any:
    if isinstance(rotary, RopeTables):
        return rotary.padded(total)
    cos, sin = rotary[0], rotary[1]
    if cos.shape[1] >= total:
        return rotary
    extra = total - cos.shape[1]
    cos = torch.cat([cos, cos.new_zeros(1, extra, *cos.shape[2:])], dim=1)
    sin = torch.cat([sin, sin.new_zeros(1, extra, *sin.shape[2:])], dim=1)
    return (cos, sin)


class _UlyssesBlockHook(ModelHook):
    """Shards a block's inputs along the sequence; the first block also shards hidden states."""

    def __init__(
        self, context: ForwardContext, exchange: TokenShards, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.context, self.exchange, self.first, self.last = context, exchange, first, last

    def _local(self, name: str, source: Any, cut: Callable[[Any], Any]) -> Any:
        # Every block gets the same per-token inputs: cut them once per forward.
        cached = self.context.local.get(name)
        if cached is not None and cached[0] is source:
            return cached[1]
        local = cut(source)
        self.context.local[name] = (source, local)
        return local

    def _local_temb(self, temb: torch.Tensor) -> torch.Tensor:
        order = self.context.token_order
        if order is not None:
            temb = tiling.reorder(temb, order, seq_dim=1)
        return self.exchange.shard(temb, self.context.shard_len)

    def _local_rotary(self, rotary: Any) -> Any:
        ctx, ex = self.context, self.exchange
        if ctx.token_order is not None:
            rotary = _reorder_rotary(rotary, ctx.token_order)
        rotary = _pad_rotary(rotary, ctx.shard_len * ex.degree)
        start = ex.rank * ctx.shard_len
        if isinstance(rotary, RopeTables):
            return rotary.narrow(start, ctx.shard_len)
        return tuple(t.narrow(1, start, ctx.shard_len) for t in rotary)

    def pre_forward(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: Any,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx, ex = self.context, self.exchange
        if self.first:
            if ctx.token_order is not None:
                hidden_states = tiling.reorder(hidden_states, ctx.token_order, seq_dim=1)
            hidden_states = ex.shard(hidden_states, ctx.shard_len)
        if temb.ndim == 4:  # Wan2.2 TI2V: one modulation per token
            temb = self._local("temb", temb, self._local_temb)
        rotary = self._local("rotary", rotary_emb, self._local_rotary)
        return (hidden_states, encoder_hidden_states, temb, rotary), {}

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        if self.last:
            output = self.exchange.gather(output, self.context.seq_len)
            if self.context.token_order is not None:
                output = tiling.restore(output, self.context.token_order, seq_dim=1)
        return output


@dataclass
class WanTransformerState:
    """liteboost's attachments to one WanTransformer3DModel, shared by boost and parallel plans."""

    context: ForwardContext = field(default_factory=ForwardContext)
    settings: AttentionSettings = field(default_factory=AttentionSettings)
    original_processors: dict[str, Any] | None = None
    users: set[str] = field(default_factory=set)


def _state(model: Any) -> WanTransformerState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        state = WanTransformerState()
        setattr(model, _STATE_ATTR, state)
    return state


def _attach(model: Any, user: str) -> WanTransformerState:
    """Install the boosted processors and the grid hook (once per model), register ``user``."""
    state = _state(model)
    if not state.users:
        state.original_processors = dict(model.attn_processors)
        processor = BoostedWanAttnProcessor(state.settings, state.context)
        model.set_attn_processor(processor)
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(_GridHook(state.context, model.config.patch_size), "liteboost.grid")
    state.users.add(user)
    return state


def _grid_hook(model: torch.nn.Module) -> _GridHook:
    """The transformer's grid hook, installed by :func:`_attach`."""
    hook = HookRegistry.check_if_exists_or_initialize(model).get_hook("liteboost.grid")
    if not isinstance(hook, _GridHook):
        raise RuntimeError(f"{type(model).__name__} has no liteboost grid hook (not attached)")
    return hook


def _detach(model: Any, user: str) -> None:
    state = _state(model)
    state.users.discard(user)
    if not state.users:
        model.set_attn_processor(state.original_processors)
        HookRegistry.check_if_exists_or_initialize(model).remove_hook(
            "liteboost.grid", recurse=False
        )
        delattr(model, _STATE_ATTR)


@dataclass
class _WanBoostHandle:
    model: Any
    previous: AttentionSettings
    rope_hooked: bool

    def remove(self) -> None:
        state = _state(self.model)
        s = state.settings
        s.sparsity, s.block_size = self.previous.sparsity, self.previous.block_size
        s.attention_backend, s.sparse_kernel = (
            self.previous.attention_backend,
            self.previous.sparse_kernel,
        )
        if self.rope_hooked:
            HookRegistry.check_if_exists_or_initialize(self.model.rope).remove_hook(
                "liteboost.rope"
            )
        _detach(self.model, "boost")


@register_boost("WanTransformer3DModel")
def boost_wan_transformer(model: Any, config: BoostConfig) -> _WanBoostHandle:
    """Sparse self-attention, the dense backend chain and cached RoPE on a Wan transformer."""
    state = _attach(model, "boost")
    s = state.settings
    previous = AttentionSettings(s.sparsity, s.block_size, s.attention_backend, s.sparse_kernel)
    s.sparsity, s.block_size = config.sparsity, config.block_size
    s.attention_backend, s.sparse_kernel = config.attention_backend, config.sparse_kernel
    if config.rope_cache:
        head_dim = model.config.attention_head_dim
        registry = HookRegistry.check_if_exists_or_initialize(model.rope)
        registry.register_hook(_CachedRopeHook(state.context, head_dim), "liteboost.rope")
    return _WanBoostHandle(model, previous, config.rope_cache)


@register_parallel("WanTransformer3DModel")
def parallelize_wan_transformer(model: Any, config: ParallelConfig) -> WanParallelHandle | None:
    """CFG x Ring x Ulysses on the transformer (``liteboost.parallel.wan``); None when all are 1."""
    from liteboost.parallel.wan import parallelize_transformer

    return parallelize_transformer(model, config)


@dataclass
class _VaeHandle:
    vae: Any

    def remove(self) -> None:
        del self.vae.decode
        del self.vae.encode


@register_parallel("AutoencoderKLWan")
def parallelize_wan_vae(vae: Any, config: ParallelConfig) -> _VaeHandle | None:
    """Temporal DP decode and encode over ``config.group_for_vae``; None when off or on one rank."""
    if not config.vae_parallel or config.world_size <= 1:
        return None
    from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    stock_decode = type(vae).decode.__get__(vae)
    stock_encode = type(vae).encode.__get__(vae)
    group, field_override = config.group_for_vae, config.vae_receptive_field

    def decode(z: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple[torch.Tensor]:
        frames = vae_dp.parallel_decode(
            vae, z, lambda x: stock_decode(x).sample, group, field_override, config.vae_mode
        )
        return DecoderOutput(sample=frames) if return_dict else (frames,)

    def encode(
        x: torch.Tensor, return_dict: bool = True
    ) -> AutoencoderKLOutput | tuple[DiagonalGaussianDistribution]:
        moments = vae_dp.parallel_encode(
            vae, x, lambda v: stock_encode(v).latent_dist.parameters, group, field_override
        )
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    # Instance attributes shadow the class methods for this VAE only; remove() deletes them.
    vae.decode, vae.encode = decode, encode
    return _VaeHandle(vae)
