"""Sparsity 0: the reordered block-sparse path with every block kept vs dense SDPA.

The release this package follows claimed the reordered sparse path beats dense attention even at
sparsity 0. This measures it with liteboost's kernels: tile reorder, plan (every key block kept),
kernel, restore, against one dense SDPA call on the untiled tensors, interleaved rounds. Both
compute the same attention (outputs compared). ``sparse_attention(sparsity=0)`` itself routes
to the dense chain; this script times the path it avoids.

    python packages/liteboost/benchmarks/sparsity_zero.py --out DIR [--rounds N]
"""

from __future__ import annotations

import argparse

import torch
from sparse_attention import attention_case, interleaved_rounds  # the sibling benchmark

from liteboost.ops.cpu_extension import load_cpu_kernel
from liteboost.ops.rain_fusion import rain_fusion_attention
from liteboost.ops.sparse_attention import plan_sparse_attention
from liteboost.ops.tiling import reorder, restore
from npu_core.bench import BenchTable, Timing

# (grid, heads, head_dim): the shapes of benchmarks/sparse_attention.py up to S = 8192.
CASES = [((4, 32, 32), 8, 64), ((8, 32, 32), 4, 64), ((8, 32, 32), 4, 128)]
BLOCK = 128
KERNELS = ("cpu", "gather")


def run_case(grid, heads, dim, rounds: int, table: BenchTable) -> None:
    seq = grid[0] * grid[1] * grid[2]
    q, k, v, dense = attention_case(grid, heads, dim)

    def reordered(kernel):
        def call():
            plan = plan_sparse_attention(q, k, latent_shape=grid, sparsity=0.0, block_size=BLOCK)
            qt, kt, vt = (reorder(t, plan.layout, 2) for t in (q, k, v))
            out = rain_fusion_attention(
                qt, kt, vt, plan.block_index, block_size=BLOCK, kernel=kernel
            )
            return restore(out, plan.layout, 2)

        return call

    jobs = {"dense": dense, **{k_: reordered(k_) for k_ in KERNELS}}
    reference = dense()
    diffs = {k_: (jobs[k_]() - reference).abs().max().item() for k_ in KERNELS}  # warm-up too
    samples = interleaved_rounds(jobs, rounds)
    dense_t = Timing(samples["dense"])
    for kernel in KERNELS:
        t = Timing(samples[kernel])
        table.add(
            S=seq,
            heads=heads,
            head_dim=dim,
            kernel=kernel,
            dense_ms=dense_t.median * 1e3,
            reordered_ms=t.median * 1e3,
            speedup=dense_t.median / t.median,
            max_abs_diff=diffs[kernel],
        )
    print(table.to_markdown(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for sparsity_zero.{json,md}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    args = parser.parse_args()
    load_cpu_kernel()
    table = BenchTable(
        "Sparsity 0: reordered sparse path (all blocks kept) vs dense SDPA (CPU, fp32, block 128)",
        ["S", "heads", "head_dim", "kernel", "dense_ms", "reordered_ms", "speedup", "max_abs_diff"],
        {
            "rounds": args.rounds,
            "threads": torch.get_num_threads(),
            "speedup": "dense SDPA / (plan + reorder + kernel + restore), medians",
        },
    )
    for grid, heads, dim in CASES:
        run_case(grid, heads, dim, args.rounds, table)
    table.write(args.out, "sparsity_zero")


if __name__ == "__main__":
    main()
