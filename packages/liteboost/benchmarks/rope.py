"""Cached Wan RoPE (liteboost.ops.rope) vs diffusers' own, side by side.

diffusers: ``WanRotaryPosEmbed.forward`` builds the per-token tables every transformer forward
(float64 on CPU), and ``WanAttnProcessor`` rotates q and k with strided slices in that float64.
liteboost: tables built once and cached (fp32), rotation in real fp32 arithmetic (no complex).
Table building is reported apart from the rotation, fp32 and bf16 activations.

``--device cuda`` puts the diffusers module, the tables and q/k on the GPU; ``npu_core.bench``
synchronises the device around every sample (wall clock), and ``--calls`` batches calls per
sample, since one call there takes microseconds. ``--frames 21`` is the 81-frame clip (32760
tokens).

    python packages/liteboost/benchmarks/rope.py --out DIR
    python packages/liteboost/benchmarks/rope.py --out DIR --device cuda --frames 21 --calls 20
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from liteboost.ops.rope import apply_rope, build_rope_tables, rope_tables
from npu_core.bench import BenchTable, compare

# Wan2.1 1.3B at 480p: 12 heads of 128; 5 latent frames of 30 x 52 tokens (a 17-frame clip).
GRID = (5, 30, 52)
HEADS, HEAD_DIM = 12, 128


class Run(NamedTuple):
    """Where and how the comparison runs."""

    grid: tuple[int, int, int]
    device: torch.device
    repeats: int
    calls: int
    sync: Callable[[], None]


def _diffusers_rotate(x, freqs_cos, freqs_sin):
    # diffusers 0.42.1 WanAttnProcessor.apply_rotary_emb, verbatim arithmetic.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _bench_dtype(dtype, rope, latent, tables, run: Run, table) -> None:
    frames, height, width = run.grid
    seq = frames * height * width
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).to(run.device, dtype)
    k = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).to(run.device, dtype)
    name = str(dtype).removeprefix("torch.")
    timing = dict(repeats=run.repeats, calls=run.calls, sync=run.sync)

    def stock():
        cos, sin = rope(latent)  # diffusers rebuilds these every forward
        return _diffusers_rotate(q, cos, sin), _diffusers_rotate(k, cos, sin)

    def boosted():
        t = rope_tables(HEAD_DIM, run.grid, device=run.device)  # cache hit after the first call
        return apply_rope(q, t.pair_cos, t.pair_sin), apply_rope(k, t.pair_cos, t.pair_sin)

    result = compare(stock, boosted, **timing)
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
        **timing,
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
    parser.add_argument("--calls", type=int, default=1, help="calls timed per sample")
    parser.add_argument("--frames", type=int, default=GRID[0], help="latent frames (21: 81)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if args.frames < 1 or args.repeats < 1 or args.calls < 1:
        parser.error("--frames, --repeats and --calls must be >= 1")
    grid = (args.frames, GRID[1], GRID[2])

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run = Run(grid, device, args.repeats, args.calls, sync)
    frames, height, width = grid
    rope = WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=1024).to(device)
    latent = torch.zeros(1, 1, frames, 2 * height, 2 * width, device=device)
    table = BenchTable(
        f"Wan RoPE: liteboost (cached fp32 tables) vs diffusers 0.42.1 ({device.type})",
        ["case", "dtype", "diffusers_ms", "liteboost_ms", "speedup", "max_abs_diff"],
        {
            "grid": grid,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "repeats": args.repeats,
            "calls_per_sample": args.calls,
            "device": device.type,
        },
    )
    tables = build_rope_tables(HEAD_DIM, grid, device=device)
    build = compare(
        lambda: rope(latent),
        lambda: build_rope_tables(HEAD_DIM, grid, device=device),
        repeats=args.repeats,
        calls=args.calls,
        sync=sync,
    )
    table.add(
        case="table build (uncached)",
        dtype="-",
        diffusers_ms=build.baseline.median * 1e3,
        liteboost_ms=build.candidate.median * 1e3,
        speedup=build.speedup,
    )
    for dtype in (torch.float32, torch.bfloat16):
        _bench_dtype(dtype, rope, latent, tables, run, table)
    print(table.to_markdown())
    table.write(args.out, "rope")


if __name__ == "__main__":
    main()
