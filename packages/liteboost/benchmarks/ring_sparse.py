"""Ring attention's chunks: fused CPU kernel vs block gather, against the dense ring and 1 rank.

Self-attention alone (no transformer around it), at the token count of ``hybrid.py``'s sparse
table (4 x 32 x 32 = 4096 tokens, 4 heads of 32, blocks of 64, sparsity 0.5), on gloo CPU
ranks started by npu-core's launcher (one intra-op thread each, so one rank stands for one
device). Variants, interleaved in every round (the order rotates):

- ``ring dense``: ``RingAttention`` (dense chunks, log-sum-exp merge);
- ``ring sparse, gather``: ``RingAttention.sparse(kernel="gather")``, the kernel of 0.4.2;
- ``ring sparse, fused``: ``RingAttention.sparse(kernel="cpu")``, the default since 0.4.3;
- ``1 rank dense`` / ``1 rank sparse``: SDPA / ``sparse_attention`` (fused kernel) over the
  whole sequence on rank 0 while the other ranks wait at a barrier.

Each sample is the wall time between two barriers (so a ring sample waits for its slowest rank)
and every rank's CPU time (``time.process_time``); the table reports medians and quartiles of
the wall time and the busiest rank's median CPU time. The ring outputs are checked against the
1-rank ones (max abs diff). With more ranks than free cores the ring rows measure overhead, not
scaling.

    python packages/liteboost/benchmarks/ring_sparse.py --out DIR [--world 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from liteboost.ops import tiling
from liteboost.ops.cpu_extension import load_cpu_kernel
from liteboost.ops.sparse_attention import sparse_attention
from liteboost.parallel.ring import RingAttention, tiled_chunk
from npu_core.bench import BenchTable, Timing
from npu_core.dist import launch

VARIANTS = (
    "1 rank dense",
    "1 rank sparse",
    "ring dense",
    "ring sparse, gather",
    "ring sparse, fused",
)


def _qkv(grid: tuple[int, int, int], heads: int, dim: int) -> list[torch.Tensor]:
    """Seeded q, k, v [1, heads, S, dim], spatially smooth plus noise (as trained DiTs attend
    locally), so the kept blocks are not random."""
    gen = torch.Generator().manual_seed(0)
    frames, height, width = grid
    f, h, w = torch.meshgrid(
        torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"
    )
    pos = torch.stack([f, h, w], dim=-1).reshape(-1, 3).float()
    phase = pos @ (torch.randn(3, dim // 2, generator=gen) * 0.6)
    feats = torch.cat([phase.cos(), phase.sin()], dim=-1) * math.sqrt(dim)
    seq = feats.shape[0]
    return [
        feats.expand(1, heads, seq, dim) + 0.3 * torch.randn(1, heads, seq, dim, generator=gen)
        for _ in range(3)
    ]


@torch.no_grad()
def _rank(
    rounds: int, grid: tuple[int, int, int], heads: int, dim: int, sparsity: float, block: int
) -> dict[str, Any]:
    load_cpu_kernel()
    rank, world = dist.get_rank(), dist.get_world_size()
    ring = RingAttention(None)
    q, k, v = _qkv(grid, heads, dim)
    seq = math.prod(grid)
    # Dense ring: raster chunks, BSND, padded to equal lengths.
    chunk = math.ceil(seq / world)
    padded = [F.pad(t, (0, 0, 0, chunk * world - seq)) for t in (q, k, v)]
    dense_chunks = [
        t[:, :, rank * chunk : (rank + 1) * chunk].transpose(1, 2).contiguous() for t in padded
    ]
    sparse_chunks = [tiled_chunk(t, grid, world, rank, block_size=block) for t in (q, k, v)]

    def one_dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    def one_sparse() -> torch.Tensor:
        return sparse_attention(q, k, v, latent_shape=grid, sparsity=sparsity, block_size=block)

    def ring_dense() -> torch.Tensor:
        return ring(*dense_chunks, seq_len=seq)

    def ring_sparse(kernel: str) -> Callable[[], torch.Tensor]:
        return lambda: ring.sparse(
            *sparse_chunks, latent_shape=grid, sparsity=sparsity, block_size=block, kernel=kernel
        )

    jobs: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {
        "1 rank dense": (one_dense, False),
        "1 rank sparse": (one_sparse, False),
        "ring dense": (ring_dense, True),
        "ring sparse, gather": (ring_sparse("gather"), True),
        "ring sparse, fused": (ring_sparse("cpu"), True),
    }
    wall: dict[str, list[float]] = {name: [] for name in jobs}
    cpu: dict[str, list[float]] = {name: [] for name in jobs}
    outputs: dict[str, torch.Tensor] = {}
    names = list(jobs)
    for r in range(rounds + 1):  # round 0 warms up (allocations, gloo pairs)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, everyone = jobs[name]
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            if everyone or rank == 0:
                outputs[name] = fn()
            cpu_s = time.process_time() - cpu_start
            dist.barrier()
            if r > 0:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_s)
    diff = _diffs(outputs, grid, world, rank, block, seq)
    return {"wall": wall, "cpu": cpu, "diff": diff}


def _diffs(
    outputs: dict[str, torch.Tensor],
    grid: tuple[int, int, int],
    world: int,
    rank: int,
    block: int,
    seq: int,
) -> dict[str, float]:
    """Max abs diff of every ring output (gathered) against its 1-rank counterpart, on rank 0."""
    gathered = {}
    for name in ("ring dense", "ring sparse, gather", "ring sparse, fused"):
        parts = [torch.empty_like(outputs[name]) for _ in range(world)]
        dist.all_gather(parts, outputs[name].contiguous())
        gathered[name] = parts
    if rank != 0:
        return {}
    dense = torch.cat(gathered["ring dense"], dim=1)[:, :seq].transpose(1, 2)
    layout = tiling.tile_layout(grid, tiling.default_tile(block), "cpu", True)
    diff = {"ring dense": (dense - outputs["1 rank dense"]).abs().max().item()}
    for name in ("ring sparse, gather", "ring sparse, fused"):
        tiled = torch.cat(gathered[name], dim=2)[:, :, :seq]
        got = tiling.restore(tiled, layout, seq_dim=2)
        diff[name] = (got - outputs["1 rank sparse"]).abs().max().item()
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ring_sparse.{json,md}")
    parser.add_argument("--world", type=int, default=2, help="ranks (>= 2)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--grid", default="4x32x32", help="post-patch frames x height x width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    try:
        grid = tuple(int(x) for x in args.grid.split("x"))
    except ValueError:
        grid = ()
    if len(grid) != 3 or min(grid) < 1:
        parser.error(f"--grid {args.grid!r}: expected FxHxW, e.g. 4x32x32")
    if args.world < 2 or args.rounds < 1 or not 0 < args.sparsity < 1:
        parser.error("--world >= 2, --rounds >= 1 and --sparsity in (0, 1) are required")
    ranks = launch(
        _rank,
        args.world,
        args.rounds,
        grid,
        args.heads,
        args.dim,
        args.sparsity,
        args.block_size,
        timeout=1800,
    )
    tokens = math.prod(grid)
    table = BenchTable(
        f"Ring attention chunks: fused CPU kernel vs block gather, {tokens} tokens, "
        f"{args.heads} x {args.dim}, sparsity {args.sparsity}, blocks of {args.block_size}, "
        f"{args.world} gloo ranks",
        [
            "variant",
            "wall_ms",
            "p25_ms",
            "p75_ms",
            "vs_ring_dense",
            "busiest_cpu_ms",
            "max_abs_diff",
        ],
        {
            "grid": list(grid),
            "rounds": args.rounds,
            "world": args.world,
            "wall_ms": "median wall time between two barriers (rank 0's clock)",
            "busiest_cpu_ms": "largest per-rank median CPU time (1-rank rows: rank 0's)",
            "vs_ring_dense": "ring dense wall / this variant's wall (> 1 = faster)",
        },
    )
    ring_dense = Timing(ranks[0]["wall"]["ring dense"]).median
    for name in VARIANTS:
        timing = Timing(ranks[0]["wall"][name])
        busiest = max(Timing(r["cpu"][name]).median for r in ranks)
        table.add(
            variant=name,
            wall_ms=timing.median * 1e3,
            p25_ms=timing.p25 * 1e3,
            p75_ms=timing.p75 * 1e3,
            vs_ring_dense=ring_dense / timing.median,
            busiest_cpu_ms=busiest * 1e3,
            max_abs_diff=ranks[0]["diff"].get(name, 0.0),
        )
    print(table.to_markdown(), flush=True)
    table.write(args.out, "ring_sparse")


if __name__ == "__main__":
    main()
