"""Benchmark: the overlap_b_f ablation on torch's DualPipeV (paired forward/backward actions).

Step time of one pipeline step on 2 gloo CPU ranks (V layout: 4 stages, 2 per rank), same model
and micro-batches, three ways: no recompute; recompute inside backward (checkpointed blocks,
plain ``ScheduleDualPipeV``); early recompute (``EarlyRecomputeDualPipeV``: each pair's backward
micro-batch recomputed right before the paired forward). Variants run interleaved, round by
round; times are the slowest rank's, ratios are medians of per-round ratios.

Run: ``uv run python packages/hyperparallel/benchmarks/pipeline_recompute.py --out DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

from hyperparallel.activation import EarlyRecomputeDualPipeV, checkpoint_wrapper
from npu_core.bench import BenchTable
from npu_core.dist import launch

WORLD, STAGES = 2, 4
RANK_STAGES = {0: (0, 3), 1: (1, 2)}
DIM, HIDDEN, BLOCKS_PER_STAGE = 256, 1024, 2
MICRO_BATCHES, TOKENS = 8, 8 * 64
REPEATS = 7
VARIANTS = ("no recompute", "recompute in backward", "early recompute (paired)")


class Block(nn.Module):
    """Pre-norm MLP block with a residual: the recompute of LayerNorm and GELU is real work."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _stage_module(stage: int) -> nn.Sequential:
    torch.manual_seed(stage)
    return nn.Sequential(*(Block() for _ in range(BLOCKS_PER_STAGE)))


def _schedule(variant: str) -> ScheduleDualPipeV:
    stages = []
    for index in RANK_STAGES[dist.get_rank()]:
        module = _stage_module(index)
        if variant != VARIANTS[0]:
            for block in module:
                checkpoint_wrapper(block, "selective")  # matmuls saved, the rest recomputed
        stages.append(PipelineStage(module, index, STAGES, torch.device("cpu")))
    kind = EarlyRecomputeDualPipeV if variant == VARIANTS[2] else ScheduleDualPipeV
    return kind(stages, MICRO_BATCHES, loss_fn=F.mse_loss)


def _rank() -> dict[str, list[float]]:
    torch.set_num_threads(1)
    schedules = {variant: _schedule(variant) for variant in VARIANTS}
    torch.manual_seed(100)
    x, target = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for repeat in range(REPEATS + 1):
        for variant, schedule in schedules.items():
            for stage in schedule._stages:
                stage.submod.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            if dist.get_rank() == 0:
                schedule.step(x, target=target)
            else:
                schedule.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat:  # the first round warms up
                times[variant].append(elapsed.item())
    return times


def _table() -> BenchTable:
    times = launch(_rank, WORLD, timeout=1200)[0]
    table = BenchTable(
        f"DualPipeV step on {WORLD} CPU ranks x 2 stages, {MICRO_BATCHES} micro-batches, "
        f"{STAGES * BLOCKS_PER_STAGE} MLP blocks of {DIM}/{HIDDEN} (median of {REPEATS}, "
        "slowest rank, one thread per rank)",
        ["variant", "step ms", "vs no recompute", "vs recompute in backward"],
    )
    for variant in VARIANTS:
        vs_none = [v / n for v, n in zip(times[variant], times[VARIANTS[0]], strict=True)]
        vs_bwd = [v / b for v, b in zip(times[variant], times[VARIANTS[1]], strict=True)]
        table.add(
            variant=variant,
            **{
                "step ms": statistics.median(times[variant]) * 1e3,
                "vs no recompute": statistics.median(vs_none),
                "vs recompute in backward": statistics.median(vs_bwd),
            },
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/hyperparallel", help="Output folder.")
    args = parser.parse_args()
    table = _table()
    table.write(args.out, "pipeline_recompute")
    print(table.to_markdown())


if __name__ == "__main__":
    main()
