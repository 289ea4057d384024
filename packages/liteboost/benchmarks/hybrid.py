"""Hybrid layouts (CFG x Ring x Ulysses): one CFG denoising step on 2 and 4 ranks vs 1 rank.

One denoising step of diffusers' Wan pipelines is two transformer calls, ``cache_context("cond")``
then ``("uncond")``; this script times exactly that pair (the scheduler step is negligible) on a
small Wan transformer at a token count where self-attention is most of the work, for every
layout of ``ParallelManager`` on gloo CPU ranks started by npu-core's launcher (one thread per
rank). The 1-rank baseline runs on rank 0 alone while the other ranks wait at a barrier, so it is
the step on one core with one thread. Layouts and the baseline alternate within each round
(interleaved rounds, median and quartiles); every layout's output is checked against the
baseline's first.

Besides the wall time, every rank records its CPU time for the step (``time.process_time``:
all its threads, gloo's included; on a shared, loaded machine the wall time also counts other
jobs, the CPU time does not) and how long it was blocked in collectives (Ulysses
all-to-alls, the ring's send/receive waits, block-sum and CFG all-gathers, the final token
gather): "comm" below. That includes waiting for a slower peer, so it is an upper bound on
communication cost, and "compute" is the step time minus it.

    python packages/liteboost/benchmarks/hybrid.py --out DIR [--rounds 5] [--frames 4 --size 32]
        [--sparsity 0.5 --block-size 64]   # block-sparse: 1 rank vs the layouts' sparse paths

With more ranks than cores (4 ranks on a 2-core machine) the ranks share cores: such rows
measure the layouts' overhead, not their scaling.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import liteboost
from liteboost.tiny import build_tiny_pipeline, build_tiny_transformer
from npu_core.bench import BenchTable, Timing
from npu_core.dist import launch

# Wan's proportions scaled down: 4 heads of 32, FFN 2x dim, 2 blocks; at 4096 tokens
# self-attention is most of a block's FLOPs (4 S^2 d vs about 16 S d^2 for the projections/FFN).
CONFIG = dict(num_attention_heads=4, attention_head_dim=32, text_dim=16, ffn_dim=256, num_layers=2)
LAYOUTS = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)],
}
"""World size -> (cfg, ulysses, ring) degrees."""
_COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce")


class _CommClock:
    """Seconds this rank spends blocked in torch.distributed calls made by liteboost."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: dict[str, Any] = {}

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def _timed_p2p(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = self

        class _Work:
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self) -> Any:
                start = time.perf_counter()
                try:
                    return self.work.wait()
                finally:
                    clock.seconds += time.perf_counter() - start

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            work = fn(*args, **kwargs)
            return None if work is None else _Work(work)

        return wrapper

    def install(self) -> None:
        for name in _COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._timed(self._saved[name]))
        for name in ("isend", "irecv"):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._timed_p2p(self._saved[name]))


def _step_inputs(frames: int, size: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, frames, 2 * size, 2 * size, generator=gen)
    return {
        branch: {
            "hidden_states": latents,
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 16, 16, generator=gen),
        }
        for branch in ("cond", "uncond")
    }


def _step(model: torch.nn.Module, inputs: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """One CFG denoising step's transformer work, as WanPipeline calls it."""
    outs = []
    for branch in ("cond", "uncond"):
        with model.cache_context(branch):
            outs.append(model(**inputs[branch], return_dict=False)[0])
    return outs[1] + 5.0 * (outs[0] - outs[1])


@torch.no_grad()
def _rank(
    world: int, rounds: int, frames: int, size: int, sparsity: float, block_size: int
) -> dict[str, Any]:
    clock = _CommClock()
    clock.install()
    barrier = dist.barrier  # not timed: it brackets the step
    pipe = build_tiny_pipeline()
    pipe.transformer = build_tiny_transformer(**CONFIG)
    pipe._guidance_scale = 5.0  # do_classifier_free_guidance: both branches every step
    model = pipe.transformer
    if sparsity > 0:
        liteboost.BoostManager(model, sparsity=sparsity, block_size=block_size)
    inputs = _step_inputs(frames, size)
    rank = dist.get_rank()
    reference = _step(model, inputs) if rank == 0 else None
    layouts = LAYOUTS[world]
    times: dict[str, list[float]] = {"1 rank": []}
    cpu: dict[str, list[float]] = {"1 rank": []}
    comm: dict[str, list[float]] = {}
    diff: dict[str, float] = {}
    for _ in range(rounds):
        barrier()
        if rank == 0:
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(model, inputs)
            times["1 rank"].append(time.perf_counter() - start)
            cpu["1 rank"].append(time.process_time() - cpu_start)
        barrier()
        for cfg, ulysses, ring in layouts:
            name = " x ".join(
                f"{kind}{d}"
                for kind, d in (("cfg", cfg), ("ulysses", ulysses), ("ring", ring))
                if d > 1
            )
            with liteboost.ParallelManager(
                pipe, cfg_degree=cfg, ulysses_degree=ulysses, ring_degree=ring, vae_parallel=False
            ):
                _step(model, inputs)  # warm-up: first-call allocations, gloo pairs
                barrier()
                clock.seconds = 0.0
                start, cpu_start = time.perf_counter(), time.process_time()
                out = _step(model, inputs)
                cpu.setdefault(name, []).append(time.process_time() - cpu_start)
                barrier()
                times.setdefault(name, []).append(time.perf_counter() - start)
                comm.setdefault(name, []).append(clock.seconds)
            if reference is not None and name not in diff:
                diff[name] = (out - reference).abs().max().item()
    return {"times": times, "cpu": cpu, "comm": comm, "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for hybrid.{json,md}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=4, help="latent frames (post-patch)")
    parser.add_argument("--size", type=int, default=32, help="post-patch height = width")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=sorted(LAYOUTS))
    parser.add_argument("--sparsity", type=float, default=0.0, help="block sparsity (0: dense)")
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    tokens = args.frames * args.size * args.size
    table = BenchTable(
        f"Hybrid layouts, one CFG step (2 transformer calls), {tokens} tokens, "
        f"sparsity {args.sparsity}, gloo CPU ranks",
        [
            "ranks",
            "layout",
            "step_ms",
            "p25_ms",
            "p75_ms",
            "vs_1_rank",
            "cpu_ms_per_rank",
            "cpu_vs_1_rank",
            "comm_ms_per_rank",
            "compute_ms_per_rank",
            "max_abs_diff",
        ],
        {
            "config": CONFIG,
            "grid": [args.frames, args.size, args.size],
            "sparsity": args.sparsity,
            "block_size": args.block_size,
            "cpu_vs_1_rank": "1-rank CPU time / busiest rank's CPU time (the speed-up on idle "
            "cores if waiting were free)",
            "rounds": args.rounds,
            "vs_1_rank": "1-rank step / layout step (> 1 = faster)",
            "comm": "median over rounds of the mean over ranks of time blocked in collectives",
        },
    )
    for world in args.worlds:
        ranks = launch(
            _rank,
            world,
            world,
            args.rounds,
            args.frames,
            args.size,
            args.sparsity,
            args.block_size,
            timeout=1800,
        )
        single = Timing(ranks[0]["times"]["1 rank"])
        single_cpu = Timing(ranks[0]["cpu"]["1 rank"]).median
        table.add(
            ranks=1,
            layout=f"1 rank (in the {world}-rank launch)",
            step_ms=single.median * 1e3,
            p25_ms=single.p25 * 1e3,
            p75_ms=single.p75 * 1e3,
            vs_1_rank=1.0,
            cpu_ms_per_rank=single_cpu * 1e3,
            cpu_vs_1_rank=1.0,
            comm_ms_per_rank=0.0,
            compute_ms_per_rank=single.median * 1e3,
            max_abs_diff=0.0,
        )
        for name, seconds in ranks[0]["times"].items():
            if name == "1 rank":
                continue
            timing = Timing(seconds)
            per_round = [
                sum(r["comm"][name][i] for r in ranks) / world for i in range(len(seconds))
            ]
            comm = Timing(per_round).median
            busiest = max(Timing(r["cpu"][name]).median for r in ranks)
            mean_cpu = sum(Timing(r["cpu"][name]).median for r in ranks) / world
            table.add(
                ranks=world,
                layout=name,
                step_ms=timing.median * 1e3,
                p25_ms=timing.p25 * 1e3,
                p75_ms=timing.p75 * 1e3,
                vs_1_rank=single.median / timing.median,
                cpu_ms_per_rank=mean_cpu * 1e3,
                cpu_vs_1_rank=single_cpu / busiest,
                comm_ms_per_rank=comm * 1e3,
                compute_ms_per_rank=(timing.median - comm) * 1e3,
                max_abs_diff=ranks[0]["diff"][name],
            )
    print(table.to_markdown())
    table.write(args.out, "hybrid")


if __name__ == "__main__":
    main()
