"""Benchmark: time for npu_core.dist.launch to run a trivial function on N ranks, by start method.

Each launch starts N processes, initialises a gloo process group, runs one all_reduce and returns.
forkserver ranks fork from a server that imported torch once; spawn ranks each import torch.

Run: ``uv run nox -s bench`` or ``uv run python packages/npu-core/benchmarks/launch_startup.py
--out DIR``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from npu_core.bench import BenchTable, compare
from npu_core.dist import launch


def _one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/npu-core", help="Output folder.")
    parser.add_argument("--repeats", type=int, default=3, help="Launches per method and size.")
    args = parser.parse_args()
    table = BenchTable(
        "npu_core.dist.launch: start N ranks, init gloo, one all_reduce, collect (median)",
        ["ranks", "spawn (s)", "forkserver (s)", "speedup"],
    )
    for ranks in (2, 4):
        result = compare(
            lambda ranks=ranks: launch(_one_all_reduce, ranks, start_method="spawn"),
            lambda ranks=ranks: launch(_one_all_reduce, ranks, start_method="forkserver"),
            warmup=1,
            repeats=args.repeats,
            sync=lambda: None,
        )
        table.add(
            ranks=ranks,
            **{
                "spawn (s)": result.baseline.median,
                "forkserver (s)": result.candidate.median,
                "speedup": result.ratio_median,
            },
        )
    table.write(args.out, "launch_startup")
    print(table.to_markdown())


if __name__ == "__main__":
    main()
