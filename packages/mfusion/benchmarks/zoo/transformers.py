"""Transformer-family models written the way their reference code writes them (hand-written
norms, activations and rotary embeddings), sized for a 2-core CPU."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight


class HandLayerNorm(nn.Module):
    """BERT_pytorch's LayerNorm: mean and std written out."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(dim))
        self.b = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return self.a * (x - mean) / torch.sqrt(var + self.eps) + self.b


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x, rope=None, causal=False):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if rope is not None:
            cos, sin = rope
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        y = attention(q, k, v, causal).transpose(1, 2).reshape(b, s, d)
        return self.out(y)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = SelfAttention(dim, heads, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), rope, causal=True)
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Decoder-only stack: RMSNorm, RoPE, SwiGLU."""

    def __init__(self, vocab=512, dim=128, heads=4, layers=2, hidden=344, seq=64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(seq).float(), inv)
        angles = torch.cat([angles, angles], -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        rope = (self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.norm1, self.norm2 = HandLayerNorm(dim), HandLayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff2(tanh_gelu(self.ff1(self.norm2(x))))


class Bert(nn.Module):
    """BERT_pytorch-style encoder: hand-written LayerNorm and tanh GELU."""

    def __init__(self, vocab=512, dim=128, heads=4, layers=2, seq=64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.layers = nn.ModuleList(BertLayer(dim, heads) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return x


class ViTLayer(nn.Module):
    def __init__(self, dim: int, heads: int, act: str = "gelu") -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ff1, self.ff2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.ff1(self.norm2(x))
        h = h * torch.sigmoid(1.702 * h) if self.act == "quick_gelu" else nn.functional.gelu(h)
        return x + self.ff2(h)


class ViT(nn.Module):
    def __init__(
        self, image=64, patch=8, dim=128, heads=4, layers=2, classes=100, act="gelu"
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.layers = nn.ModuleList(ViTLayer(dim, heads, act) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.norm(x[:, 0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class Clip(nn.Module):
    """CLIP-style dual encoder: a text transformer and a ViT, quick-GELU, cosine logits."""

    def __init__(self, vocab=512, dim=128, seq=32) -> None:
        super().__init__()
        self.vision = ViT(dim=dim, act="quick_gelu")
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.text = nn.ModuleList(ViTLayer(dim, 4, "quick_gelu") for _ in range(2))
        self.text_norm = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        image = self.vision.features(images)
        x = self.embed(tokens) + self.pos
        for layer in self.text:
            x = layer(x)
        text = self.text_norm(x)[:, -1]
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        return self.scale.exp() * image @ text.t()


class Speech(nn.Module):
    """Speech-transformer encoder: 2-D conv subsampling of log-mel features, then attention
    layers with hand-written LayerNorm and tanh GELU."""

    def __init__(self, mels=80, dim=128, layers=2, vocab=256) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 32, 3, 2), nn.ReLU(), nn.Conv2d(32, 32, 3, 2), nn.ReLU()
        )
        self.proj = nn.Linear(32 * (((mels - 1) // 2 - 1) // 2), dim)
        self.layers = nn.ModuleList(BertLayer(dim, 4) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.conv(features.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        for layer in self.layers:
            x = layer(x)
        return self.out(x).log_softmax(-1)
