"""WanTransformer3DModel across a CFG x Ring x Ulysses mesh, through diffusers hooks.

Sequence parallelism (Ulysses and/or Ring): a post-forward hook on ``patch_embedding`` keeps this
rank's shard of the patch tokens, a per-block hook shards the per-token inputs (RoPE tables,
Wan2.2 TI2V's per-token modulation; cut once per forward), the attention processor runs
self-attention across the ranks, and a pre-forward hook on ``norm_out`` gathers the shards.

With a ring and sparsity > 0 the tokens are cut in the block-sparse kernels' tile order instead
of raster order, so that every ring chunk holds whole blocks (``RingAttention.sparse``): the
patch tokens, the RoPE rows and TI2V's per-token modulation are permuted once per forward after
the patch embedding, and the gathered tokens are put back in raster order before ``norm_out``.
Every other operation of a block acts on each token alone, so the order does not change them;
shards are then multiples of the block size (more end padding, never attended).

Cutting and gathering outside the blocks keeps every block's input and output the same shape,
so diffusers' block-level cache hooks (first-block cache, TaylorSeer, ...) compose with it in
any registration order.

CFG parallel: WanPipeline calls the transformer twice per step, ``cache_context("cond")`` then
``cache_context("uncond")``, and combines the two outputs only after the second call. A stateful
hook on the transformer reads that context name: the rank that owns the branch runs it, the other
returns an empty buffer of the output's shape at once and runs its own branch next, so both
branches run at the same time on different ranks; after the second call one all_gather fills the
buffers. Calls outside a cond/uncond context, or steps where the pipeline runs no guidance, run
on every rank as usual.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

from liteboost.attention.context import ForwardContext
from liteboost.attention.processor import AttentionSettings, BoostedWanAttnProcessor
from liteboost.cache import composes_with_sequence_parallel
from liteboost.models.wan_state import attach, detach, grid_hook, transformer_state
from liteboost.ops import tiling
from liteboost.ops.blocks import block_shape
from liteboost.ops.rope import RopeTables
from liteboost.parallel.sequence import SequenceParallel
from liteboost.parallel.ulysses import TokenShards

if TYPE_CHECKING:
    from liteboost.parallel.manager import ParallelRuntime

_CFG_HOOK = "liteboost.cfg"
_SHARD_HOOK = "liteboost.sp_shard"
_GATHER_HOOK = "liteboost.sp_gather"
_BLOCK_HOOK = "liteboost.ulysses"
BRANCHES = ("cond", "uncond")


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


class UlyssesBlockHook(ModelHook):
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


class HybridWanAttnProcessor(BoostedWanAttnProcessor):
    """The boosted Wan processor whose self-attention runs ring attention when there is a ring."""

    def _self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sp = self.settings.ulysses
        ctx = self.context
        if isinstance(sp, SequenceParallel) and sp.ring is not None:
            if self.settings.sparsity > 0 and q.shape[1] == ctx.shard_len:
                if ctx.token_order is None or ctx.grid is None:  # set by the plan's grid hook
                    raise RuntimeError("block-sparse ring attention needs tile-order shards")
                return sp.sparse_ring_attention(
                    q,
                    k,
                    v,
                    latent_shape=ctx.grid,
                    shard_len=ctx.shard_len,
                    sparsity=self.settings.sparsity,
                    block_size=self.settings.block_size,
                )
            return sp.ring_attention(q, k, v, ctx.seq_len, ctx.shard_len)
        return super()._self_attention(q, k, v)


def _sparse_ring_order(
    settings: AttentionSettings, sp: SequenceParallel, context: ForwardContext, device: torch.device
) -> None:
    """Per forward: tile order and block-aligned shards when the ring runs block-sparse.

    A ring chunk is ``ulysses_degree`` consecutive shards and must hold whole query and key
    blocks, in the tile layout ``sparse_attention`` uses (default tile, frame 0 alone).
    """
    if sp.ring is None or settings.sparsity <= 0 or context.grid is None:
        return
    q_block, kv_block = block_shape(settings.block_size)
    unit = math.lcm(q_block, kv_block)
    align = unit // math.gcd(unit, sp.ulysses_degree)
    context.set_grid(context.grid, sp.degree, align)
    context.token_order = tiling.tile_layout(
        context.grid, tiling.default_tile(kv_block), device, first_frame_alone=True
    )


class _ShardTokensHook(ModelHook):
    """patch_embedding output [B, C, F, H, W] -> this rank's tokens [B, C, shard_len]."""

    def __init__(self, context: ForwardContext, sp: SequenceParallel) -> None:
        super().__init__()
        self.context, self.sp = context, sp

    def post_forward(self, module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        # Wan continues with .flatten(2).transpose(1, 2): a no-op flatten on the 3-D shard.
        tokens = output.flatten(2)
        if self.context.token_order is not None:
            tokens = tiling.reorder(tokens, self.context.token_order, seq_dim=2)
        return self.sp.shard(tokens, self.context.shard_len, dim=2)


class _GatherTokensHook(ModelHook):
    """norm_out input [B, shard_len, C] -> every rank's tokens [B, seq_len, C]."""

    def __init__(self, context: ForwardContext, sp: SequenceParallel) -> None:
        super().__init__()
        self.context, self.sp = context, sp

    def pre_forward(
        self, module: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        tokens = self.sp.gather(hidden_states, self.context.seq_len)
        if self.context.token_order is not None:
            tokens = tiling.restore(tokens, self.context.token_order, seq_dim=1)
        return (tokens, *args), kwargs


class _NoState(BaseState):
    def reset(self, *args: Any, **kwargs: Any) -> None:
        pass


class CfgParallelHook(ModelHook):
    """Runs the "cond" branch on CFG rank 0 and "uncond" on rank 1; one all_gather per step.

    Stateful only so that diffusers' ``cache_context`` hands it the branch name.
    """

    _is_stateful = True

    def __init__(self, group: dist.ProcessGroup | None, pipeline: Any, out_channels: int) -> None:
        super().__init__()
        self.group = group
        self.pipeline = pipeline
        self.out_channels = out_channels
        # diffusers annotates state_cls as a BaseState instance; it is the class it builds.
        self.state_manager = StateManager(_NoState)  # type: ignore[arg-type]
        self.mine = BRANCHES[dist.get_rank(group)]
        self.pending: dict[str, torch.Tensor] = {}
        self.exchanges = 0

    def _branch(self) -> str | None:
        try:
            name = self.state_manager.context.name
        except ValueError:  # no cache_context: a direct call
            return None
        if name not in BRANCHES or not self.pipeline.do_classifier_free_guidance:
            return None
        return name

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = None if self.fn_ref is None else self.fn_ref.original_forward
        if forward is None:  # both set by HookRegistry.register_hook
            raise RuntimeError("CfgParallelHook called before it was registered")
        branch = self._branch()
        if branch is None:
            return forward(*args, **kwargs)
        if branch in self.pending:
            raise RuntimeError(
                f"CFG parallel saw two {branch!r} calls without the other branch in between"
            )
        if branch == self.mine:
            output = forward(*args, **kwargs)
            sample = output[0] if isinstance(output, tuple) else output.sample
        else:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            b, _, f, h, w = hidden.shape
            dtype = module.proj_out.weight.dtype
            sample = torch.empty(b, self.out_channels, f, h, w, dtype=dtype, device=hidden.device)
            if kwargs.get("return_dict", True):
                from diffusers.models.modeling_outputs import Transformer2DModelOutput

                output = Transformer2DModelOutput(sample=sample)
            else:
                output = (sample,)
        self.pending[branch] = sample
        if len(self.pending) == len(BRANCHES):
            self._exchange()
        return output

    def _exchange(self) -> None:
        """One all_gather: each rank contributes its branch and fills the other's buffer."""
        mine = self.pending[self.mine].contiguous()
        parts = [torch.empty_like(mine) for _ in BRANCHES]
        dist.all_gather(parts, mine, group=self.group)
        for name, part in zip(BRANCHES, parts, strict=True):
            if name != self.mine:
                self.pending[name].copy_(part)
        self.pending.clear()
        self.exchanges += 1

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.pending.clear()
        return module


@dataclass
class WanParallelHandle:
    """Undoes :func:`parallelize_transformer`."""

    model: Any
    sequence: bool
    cfg: bool
    block_hooks: list = field(default_factory=list)

    def remove(self) -> None:
        model = self.model
        if self.cfg:
            HookRegistry.check_if_exists_or_initialize(model).remove_hook(_CFG_HOOK, recurse=False)
        if not self.sequence:
            return
        state = transformer_state(model)
        state.settings.ulysses = None
        for block in model.blocks:
            registry = HookRegistry.check_if_exists_or_initialize(block)
            registry.remove_hook(_BLOCK_HOOK, recurse=False)
        HookRegistry.check_if_exists_or_initialize(model.patch_embedding).remove_hook(
            _SHARD_HOOK, recurse=False
        )
        HookRegistry.check_if_exists_or_initialize(model.norm_out).remove_hook(
            _GATHER_HOOK, recurse=False
        )
        grid = grid_hook(model)
        grid.world, grid.on_grid = 1, None
        if state.users - {"parallel"}:
            # Others (the boost) still use the processors: back to the single-device one.
            model.set_attn_processor(BoostedWanAttnProcessor(state.settings, state.context))
        detach(model, "parallel")


def parallelize_transformer(model: Any, runtime: ParallelRuntime) -> WanParallelHandle | None:
    """Sequence parallelism (Ulysses x Ring) and CFG parallel on a Wan transformer.

    Returns None when every degree is 1 (nothing to do).

    Raises:
        ValueError: CFG parallel for a pipeline without ``do_classifier_free_guidance``, or
            head padding refused (``pad_heads=False``) for a degree that does not divide the heads.
    """
    config = runtime.config
    ulysses_degree = config.ulysses_for(runtime.world_size)
    sequence = ulysses_degree * config.ring_degree > 1
    cfg = config.cfg_degree > 1
    if not sequence and not cfg:
        return None
    if cfg and not hasattr(type(runtime.pipeline), "do_classifier_free_guidance"):
        raise ValueError(
            f"cfg_degree={config.cfg_degree}: {type(runtime.pipeline).__name__} has no "
            "do_classifier_free_guidance; CFG parallel supports diffusers' Wan pipelines"
        )
    cached = getattr(model, "_liteboost_cache", None)
    if sequence and cached is not None and not composes_with_sequence_parallel(cached):
        raise ValueError(
            f"the transformer's {type(cached).__name__} decides from data each sequence-parallel "
            "rank holds only a shard of; remove that cache before ulysses_degree/ring_degree > 1"
        )
    handle = WanParallelHandle(model, sequence=sequence, cfg=cfg)
    if sequence:
        sp = SequenceParallel(
            runtime.sp_group,
            runtime.ulysses_group if ulysses_degree > 1 else None,
            runtime.ring_group if config.ring_degree > 1 else None,
            model.config.num_attention_heads,
            config.pad_heads,
        )
        state = attach(model, "parallel")
        state.settings.ulysses = sp
        model.set_attn_processor(HybridWanAttnProcessor(state.settings, state.context))
        grid = grid_hook(model)
        grid.world = sp.degree
        grid.on_grid = functools.partial(_sparse_ring_order, state.settings, sp)
        HookRegistry.check_if_exists_or_initialize(model.patch_embedding).register_hook(
            _ShardTokensHook(state.context, sp), _SHARD_HOOK
        )
        HookRegistry.check_if_exists_or_initialize(model.norm_out).register_hook(
            _GatherTokensHook(state.context, sp), _GATHER_HOOK
        )
        for block in model.blocks:
            hook = UlyssesBlockHook(state.context, sp, first=False, last=False)
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _BLOCK_HOOK)
    if cfg:
        out_channels = model.config.out_channels or model.config.in_channels
        cfg_hook = CfgParallelHook(runtime.cfg_group, runtime.pipeline, out_channels)
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(cfg_hook, _CFG_HOOK)
        registry.invalidate_child_registries_cache()
    return handle
