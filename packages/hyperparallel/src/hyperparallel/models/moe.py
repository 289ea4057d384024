"""A small decoder-only MoE transformer: RMSNorm, RoPE attention, routed SwiGLU experts.

Expert weights are stored as ``[E, M, N]`` parameters (one tensor per projection for all experts),
the layout distributed Muon orthogonalises as a batch of E matrices; FSDP2 shards them on E.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from hyperparallel._config import StrictModel


class MoEConfig(StrictModel):
    """Model shape; every field is a ``--set model.<field>=...`` override of the train CLI."""

    vocab_size: int = Field(256, ge=2, description="Tokens in the vocabulary (256 for bytes).")
    dim: int = Field(128, ge=8, description="Hidden size.")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads; must divide dim.")
    n_experts: int = Field(4, ge=1, description="Experts per MoE layer.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    ffn_dim: int = Field(256, ge=8, description="Hidden size of each SwiGLU expert.")
    max_seq_len: int = Field(256, ge=2, description="Longest sequence the RoPE tables cover.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"n_heads={self.n_heads} must divide dim={self.dim} into an even head size"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        return self


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[seq_len, head_dim // 2]`` fp32, for rotating channel pairs."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, H, S, D]`` by position; cos/sin ``[S, D/2]``; computed in fp32."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions (torch SDPA kernel)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with weights ``w_gate, w_up: [E, dim, ffn]``, ``w_down: [E,
    ffn, dim]``. Returns the output and the load-balancing loss (Switch-style: E * sum_e of
    token fraction x mean router probability, 1.0 when perfectly balanced)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        scale_in, scale_ffn = cfg.dim**-0.5, cfg.ffn_dim**-0.5
        self.w_gate = nn.Parameter(torch.randn(cfg.n_experts, cfg.dim, cfg.ffn_dim) * scale_in)
        self.w_up = nn.Parameter(torch.randn(cfg.n_experts, cfg.dim, cfg.ffn_dim) * scale_in)
        self.w_down = nn.Parameter(torch.randn(cfg.n_experts, cfg.ffn_dim, cfg.dim) * scale_ffn)
        self.dispatch: Callable | None = None
        """Set by expert parallelism: runs the experts on the ranks that hold them."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).type_as(tokens)
        n_experts = probs.shape[-1]
        if self.dispatch is not None:
            out = self.dispatch(self, tokens, experts, weights)
        else:
            out = self._local_experts(tokens, experts, weights)
        fraction = F.one_hot(experts, n_experts).float().sum(dim=(0, 1)) / experts.numel()
        balance = n_experts * (fraction * probs.mean(dim=0)).sum()
        return out.view_as(x), balance

    def _local_experts(
        self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on this rank: ``tokens [T, D]``, top-k ``experts``/``weights [T, k]``."""
        out = torch.zeros_like(tokens)
        for e in range(self.w_gate.shape[0]):
            token_idx, slot = (experts == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            h = tokens[token_idx]
            h = F.silu(h @ self.w_gate[e]) * (h @ self.w_up[e])
            out.index_add_(0, token_idx, (h @ self.w_down[e]) * weights[token_idx, slot, None])
        return out


class Block(nn.Module):
    """Pre-norm transformer block: attention then MoE feed-forward, both residual."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = MoEFeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        ffn_out, balance = self.ffn(self.ffn_norm(x))
        return x + ffn_out, balance


class MoETransformer(nn.Module):
    """Token embedding, blocks, final norm, untied output head."""

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.dim // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens: [B, S]`` int64 -> (logits ``[B, S, vocab]``, mean load-balancing loss)."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        balance = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, layer_balance = layer(x, cos, sin)
            balance = balance + layer_balance
        return self.lm_head(self.norm(x)), balance / len(self.layers)
