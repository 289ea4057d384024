"""Ulysses overhead: a Wan transformer forward on 2 ranks vs the same forward in one process.

Each rank runs with one thread (npu-core's launcher gives a rank usable CPUs / world threads), so
"single" is the whole forward on one core and "ulysses" the same forward split over two cores
with two all-to-alls per self-attention and a gather at the end: the ratio is the parallel
gain net of communication and padding. Both are timed in interleaved rounds between barriers.

    python packages/liteboost/benchmarks/ulysses.py --out DIR
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import liteboost
from liteboost.tiny import build_tiny_transformer
from npu_core.bench import BenchTable, Timing
from npu_core.dist import launch

CONFIG = dict(num_attention_heads=4, attention_head_dim=32, text_dim=16, ffn_dim=256, num_layers=2)
GRIDS = [(5, 16, 16), (5, 15, 17)]  # 1280 tokens (even) and 1275 (uneven: padded)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _bench_grid(model, grid, rounds: int) -> dict:
    frames, height, width = grid
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 4, frames, 2 * height, 2 * width, generator=gen),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 16, 16, generator=gen),
    }
    reference = model(**inputs).sample
    manager = liteboost.ParallelManager(model)
    diff = (model(**inputs).sample - reference).abs().max().item()
    manager.remove()
    single, parallel = [], []
    for _ in range(rounds):
        single.append(_timed(lambda: model(**inputs)))
        with liteboost.ParallelManager(model):
            parallel.append(_timed(lambda: model(**inputs)))
    return {"grid": grid, "single": single, "parallel": parallel, "diff": diff}


@torch.no_grad()
def _rank(rounds: int) -> list[dict]:
    model = build_tiny_transformer(**CONFIG)
    return [_bench_grid(model, grid, rounds) for grid in GRIDS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ulysses.{json,md}")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = launch(_rank, 2, args.rounds, timeout=900)[0]
    table = BenchTable(
        "Ulysses (2 gloo ranks, one 2-core CPU) vs single process: Wan transformer forward",
        ["tokens", "grid", "single_ms", "ulysses_ms", "ratio", "max_abs_diff"],
        {"config": CONFIG, "rounds": args.rounds, "ratio": "ulysses / single (1 = no overhead)"},
    )
    for row in rows:
        single, parallel = Timing(row["single"]), Timing(row["parallel"])
        f, h, w = row["grid"]
        table.add(
            tokens=f * h * w,
            grid=f"{f}x{h}x{w}",
            single_ms=single.median * 1e3,
            ulysses_ms=parallel.median * 1e3,
            ratio=parallel.median / single.median,
            max_abs_diff=row["diff"],
        )
    print(table.to_markdown())
    table.write(args.out, "ulysses")


if __name__ == "__main__":
    main()
