"""Eager cost of the fused CPU kernel's custom operator against calling its body directly.

Since 0.4.4 the fused kernel, its shared-block split and the log-sum-exp merge run as the
custom operator ``liteboost::fused_block_sparse_attention`` (so ``torch.compile`` keeps them as
one node). This measures what calling through torch's dispatcher costs against the operator's
plain Python body (:func:`liteboost.ops.fused_cpu.fused_attention_fp32`, what eager calls run),
side by side in interleaved rounds (the order alternates each round), several calls per sample.
Cases: the tiny Wan's self-attention (48 tokens: pure call overhead) and a 4096-token call with
128-token blocks at sparsity 0.8 (kernel time dominates).

    python packages/liteboost/benchmarks/fused_operator.py --out DIR [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from liteboost.ops.cpu_extension import load_cpu_kernel
from liteboost.ops.fused_cpu import fused_attention_fp32, fused_block_sparse_attention
from liteboost.ops.sparse_attention import plan_sparse_attention
from liteboost.ops.tiling import reorder
from npu_core.bench import BenchTable, calls_per_sample, compare

# (name, latent grid, heads, head dim, block, sparsity)
CASES = [
    ("tiny Wan self-attention", (3, 4, 4), 2, 12, 16, 0.5),
    ("S=4096, 8 x 64", (4, 32, 32), 8, 64, 128, 0.8),
]
SAMPLE_MS = 50.0


def _case(grid, heads: int, dim: int, block: int, sparsity: float):
    """Tile-ordered fp32 q, k, v [1, heads, S, dim] and their block index (as the kernel sees
    them inside ``sparse_attention``), plus the operator's arguments after them."""
    seq = grid[0] * grid[1] * grid[2]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen) for _ in range(3))
    plan = plan_sparse_attention(q, k, latent_shape=grid, sparsity=sparsity, block_size=block)
    tiled = [reorder(t, plan.layout, 2).contiguous() for t in (q, k, v)]
    return (*tiled, plan.block_index, block, block, dim**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for fused_operator.{json,md}")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2")
    if load_cpu_kernel() is None:
        parser.error("the CPU kernel extension cannot be built here (see the warning above)")
    table = BenchTable(
        "Fused CPU kernel: custom operator vs its direct body (eager, fp32)",
        [
            "case",
            "calls_per_sample",
            "direct_ms",
            "operator_ms",
            "ratio_median",
            "ratio_p25",
            "ratio_p75",
            "overhead_us",
        ],
        {
            "rounds": args.rounds,
            "ratio": "per round: operator time / direct time (above 1: the operator is slower)",
            "overhead_us": "median operator ms - median direct ms, per call, in microseconds",
            "threads": torch.get_num_threads(),
        },
    )
    for name, grid, heads, dim, block, sparsity in CASES:
        call = _case(grid, heads, dim, block, sparsity)

        def direct(call=call):
            return fused_attention_fp32(*call)

        def operator(call=call):
            return fused_block_sparse_attention(*call)

        torch.testing.assert_close(direct()[0], operator()[0], atol=0, rtol=0)
        calls = calls_per_sample(direct, SAMPLE_MS)
        result = compare(direct, operator, repeats=args.rounds, calls=calls, pause_gc=True)
        ratios = [1.0 / r for r in result.ratios]  # compare's ratios are baseline / candidate
        p25, _, p75 = statistics.quantiles(ratios, n=4, method="inclusive")
        table.add(
            case=name,
            calls_per_sample=calls,
            direct_ms=result.baseline.median * 1e3,
            operator_ms=result.candidate.median * 1e3,
            ratio_median=statistics.median(ratios),
            ratio_p25=p25,
            ratio_p75=p75,
            overhead_us=(result.candidate.median - result.baseline.median) * 1e6,
        )
    print(table.to_markdown())
    table.write(args.out, "fused_operator")


if __name__ == "__main__":
    main()
