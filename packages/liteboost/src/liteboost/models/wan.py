"""Wan2.1 / Wan2.2 plans: boost and Ulysses for WanTransformer3DModel, VAE temporal DP.

Everything is attached through diffusers' extension points: processors through
``WanAttention.set_processor``, per-forward facts through ``diffusers.hooks.HookRegistry`` hooks
on the transformer, its ``rope`` module and its blocks. Every plan returns a handle whose
``remove()`` restores the stock model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from liteboost.attention.context import ForwardContext
from liteboost.attention.processor import AttentionSettings
from liteboost.models.registry import register_boost, register_parallel
from liteboost.models.wan_state import attach, detach, transformer_state
from liteboost.ops.rope import RopeTables, rope_tables
from liteboost.parallel import vae_dp

if TYPE_CHECKING:
    from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    from liteboost.boost import BoostConfig
    from liteboost.parallel.manager import ParallelRuntime
    from liteboost.parallel.wan import WanParallelHandle

# Wan builds WanRotaryPosEmbed with its default theta.
_WAN_ROPE_THETA = 10000.0


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


@dataclass
class _WanBoostHandle:
    model: Any
    previous: AttentionSettings
    rope_hooked: bool

    def remove(self) -> None:
        state = transformer_state(self.model)
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
        detach(self.model, "boost")


@register_boost("WanTransformer3DModel")
def boost_wan_transformer(model: Any, config: BoostConfig) -> _WanBoostHandle:
    """Sparse self-attention, the dense backend chain and cached RoPE on a Wan transformer."""
    state = attach(model, "boost")
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
def parallelize_wan_transformer(model: Any, runtime: ParallelRuntime) -> WanParallelHandle | None:
    """CFG x Ring x Ulysses on the transformer (``liteboost.parallel.wan``); None when all are 1."""
    from liteboost.parallel.wan import parallelize_transformer

    return parallelize_transformer(model, runtime)


@dataclass
class _VaeHandle:
    vae: Any

    def remove(self) -> None:
        del self.vae.decode
        del self.vae.encode


@register_parallel("AutoencoderKLWan")
def parallelize_wan_vae(vae: Any, runtime: ParallelRuntime) -> _VaeHandle | None:
    """DP decode and encode over every rank of the default group; None when off or on one rank."""
    config = runtime.config
    if not config.vae_parallel or runtime.world_size <= 1:
        return None
    from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    stock_decode = type(vae).decode.__get__(vae)
    stock_encode = type(vae).encode.__get__(vae)
    group, field_override = None, config.vae_receptive_field

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
