"""A diffusers attention processor for Wan that runs liteboost's kernels.

Installed with ``WanAttention.set_processor`` (diffusers' own extension point), it computes what
``diffusers.models.transformers.transformer_wan.WanAttnProcessor`` computes, with three swaps:
RoPE from cached fp32 tables in real arithmetic, self-attention through block-sparse attention
(or the dense backend chain), and, under Ulysses, an all-to-all around self-attention.
Cross-attention (text and the I2V image branch) always runs dense and unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from liteboost.attention.backends import flash_attention
from liteboost.attention.context import ForwardContext
from liteboost.ops.rope import RopeTables, apply_rope
from liteboost.ops.sparse_attention import sparse_attention

# Wan's text encoder context length; the I2V image tokens come before it (diffusers hard-codes
# the same number in WanAttnProcessor).
_TEXT_CONTEXT = 512


class HeadExchange(Protocol):
    """The self-attention exchange of a sequence-parallel layout (``UlyssesExchange`` and
    ``SequenceParallel`` provide it): sequence shard -> whole sequence of a head shard, and back.
    """

    def scatter_heads(self, x: torch.Tensor, seq_len: int) -> torch.Tensor: ...

    def gather_heads(self, x: torch.Tensor, shard_len: int) -> torch.Tensor: ...


@dataclass
class AttentionSettings:
    """What the processor does for self-attention.

    Attributes:
        sparsity: share of key blocks skipped (0 = dense).
        block_size: tokens per sparse block.
        attention_backend: dense backend name or None for the chain.
        sparse_kernel: "npu", "cpu", "gather", "flex", "reference" or None (default per device).
        ulysses: the Ulysses exchange, or None on a single device.
    """

    sparsity: float = 0.0
    block_size: int = 128
    attention_backend: str | None = None
    sparse_kernel: str | None = None
    ulysses: HeadExchange | None = None


def _rotate_diffusers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' arithmetic, for rotary tables that are not liteboost's (rope cache off).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


def _rotate(x: torch.Tensor, rotary_emb: Any) -> torch.Tensor:
    if isinstance(rotary_emb, RopeTables):
        return apply_rope(x, rotary_emb.pair_cos, rotary_emb.pair_sin)
    return _rotate_diffusers(x, *rotary_emb)


class BoostedWanAttnProcessor:
    """Drop-in for ``WanAttnProcessor`` (same call signature) using liteboost kernels."""

    def __init__(self, settings: AttentionSettings, context: ForwardContext) -> None:
        self.settings = settings
        self.context = context

    def _projections(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if getattr(attn, "fused_projections", False):
            if encoder_hidden_states is None:
                return attn.to_qkv(hidden_states).chunk(3, dim=-1)
            return (attn.to_q(hidden_states), *attn.to_kv(source).chunk(2, dim=-1))
        return attn.to_q(hidden_states), attn.to_k(source), attn.to_v(source)

    def _self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = self.settings
        ulysses = s.ulysses
        if ulysses is not None:
            q, k, v = (ulysses.scatter_heads(t, self.context.seq_len) for t in (q, k, v))
        grid = self.context.grid
        if s.sparsity > 0 and grid is not None and q.shape[1] == self.context.seq_len:
            out = sparse_attention(
                q,
                k,
                v,
                latent_shape=grid,
                sparsity=s.sparsity,
                block_size=s.block_size,
                layout="BSND",
                kernel=s.sparse_kernel,
            )
        else:
            out = flash_attention(q, k, v, layout="BSND", backend=s.attention_backend)
        if ulysses is not None:
            out = ulysses.gather_heads(out, self.context.shard_len)
        return out

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError(
                "BoostedWanAttnProcessor does not take an attention_mask (Wan passes none)"
            )
        image_context = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            split = encoder_hidden_states.shape[1] - _TEXT_CONTEXT
            image_context = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]

        q, k, v = self._projections(attn, hidden_states, encoder_hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate(q, rotary_emb), _rotate(k, rotary_emb)

        image_out = None
        if image_context is not None:
            if getattr(attn, "fused_projections", False):
                k_img, v_img = attn.to_added_kv(image_context).chunk(2, dim=-1)
            else:
                k_img, v_img = attn.add_k_proj(image_context), attn.add_v_proj(image_context)
            k_img = attn.norm_added_k(k_img).unflatten(2, (attn.heads, -1))
            v_img = v_img.unflatten(2, (attn.heads, -1))
            image_out = flash_attention(q, k_img, v_img, backend=self.settings.attention_backend)
            image_out = image_out.flatten(2, 3).type_as(q)

        if encoder_hidden_states is None:
            out = self._self_attention(q, k, v)
        else:
            out = flash_attention(q, k, v, backend=self.settings.attention_backend)
        out = out.flatten(2, 3).type_as(q)
        if image_out is not None:
            out = out + image_out
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
