"""Cached Wan RoPE (liteboost.ops.rope) vs diffusers' own, side by side.

diffusers: ``WanRotaryPosEmbed.forward`` builds the per-token tables every transformer forward
(float64 on CPU), and ``WanAttnProcessor`` rotates q and k with strided slices in that float64.
liteboost: tables built once and cached (fp32), rotation in real fp32 arithmetic (no complex).
Table building is reported apart from the rotation, fp32 and bf16 activations.

    python packages/liteboost/benchmarks/rope.py --out DIR
"""

from __future__ import annotations

import argparse

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from liteboost.ops.rope import apply_rope, build_rope_tables, rope_tables
from npu_core.bench import BenchTable, compare

# Wan2.1 1.3B at 480p: 12 heads of 128; 5 latent frames of 30 x 52 tokens (a 17-frame clip).
GRID = (5, 30, 52)
HEADS, HEAD_DIM = 12, 128


def _diffusers_rotate(x, freqs_cos, freqs_sin):
    # diffusers 0.42.1 WanAttnProcessor.apply_rotary_emb, verbatim arithmetic.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _bench_dtype(dtype, rope, latent, tables, repeats, table) -> None:
    frames, height, width = GRID
    seq = frames * height * width
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).to(dtype)
    name = str(dtype).removeprefix("torch.")

    def stock():
        cos, sin = rope(latent)  # diffusers rebuilds these every forward
        return _diffusers_rotate(q, cos, sin), _diffusers_rotate(k, cos, sin)

    def boosted():
        t = rope_tables(HEAD_DIM, GRID)  # cache hit after the first call
        return apply_rope(q, t.pair_cos, t.pair_sin), apply_rope(k, t.pair_cos, t.pair_sin)

    result = compare(stock, boosted, repeats=repeats)
    diff = (stock()[0].float() - boosted()[0].float()).abs().max().item()
    table.add(
        case="tables + rotate q and k",
        dtype=name,
        diffusers_ms=result.baseline.median * 1e3,
        liteboost_ms=result.candidate.median * 1e3,
        speedup=result.speedup,
        max_abs_diff=diff,
    )
    cos, sin = rope(latent)
    rot = compare(
        lambda: _diffusers_rotate(q, cos, sin),
        lambda: apply_rope(q, tables.pair_cos, tables.pair_sin),
        repeats=repeats,
    )
    table.add(
        case="rotate only (tables prebuilt)",
        dtype=name,
        diffusers_ms=rot.baseline.median * 1e3,
        liteboost_ms=rot.candidate.median * 1e3,
        speedup=rot.speedup,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rope.{json,md}")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    frames, height, width = GRID
    rope = WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=1024)
    latent = torch.zeros(1, 1, frames, 2 * height, 2 * width)
    table = BenchTable(
        "Wan RoPE: liteboost (cached fp32 tables) vs diffusers 0.42.1 (CPU)",
        ["case", "dtype", "diffusers_ms", "liteboost_ms", "speedup", "max_abs_diff"],
        {"grid": GRID, "heads": HEADS, "head_dim": HEAD_DIM, "repeats": args.repeats},
    )
    tables = build_rope_tables(HEAD_DIM, GRID)
    build = compare(
        lambda: rope(latent), lambda: build_rope_tables(HEAD_DIM, GRID), repeats=args.repeats
    )
    table.add(
        case="table build (uncached)",
        dtype="-",
        diffusers_ms=build.baseline.median * 1e3,
        liteboost_ms=build.candidate.median * 1e3,
        speedup=build.speedup,
    )
    for dtype in (torch.float32, torch.bfloat16):
        _bench_dtype(dtype, rope, latent, tables, args.repeats, table)
    print(table.to_markdown())
    table.write(args.out, "rope")


if __name__ == "__main__":
    main()
