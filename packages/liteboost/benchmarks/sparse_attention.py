"""Block-sparse attention (liteboost.ops.sparse_attention) vs dense torch SDPA, side by side.

For each sequence length one dense SDPA and every sparsity run in the same interleaved rounds
(the order rotates each round). Reported apart: planning time (tile reorder + pooling + top-k),
the steady-state speed-up of the whole call (planning, reorder and restore included, CPU default
kernel: the fused C++ kernel), of the fused kernel alone, of the block-gather kernel alone and, at
sparsity 0.8, of the FlexAttention kernel alone (its BlockMask prebuilt; its compile time, first
call once per shape, in its own column). The fused kernel's build (or cache load) time is in the
table's metadata.

``--device cuda`` runs every tensor on the GPU and reads a wall clock after synchronising it. The
whole call there runs the CUDA chain's kernel (FlexAttention, compiled once per shape before the
timed rounds); the fused C++ kernel is CPU-only and is not run (its column stays empty). The
extra case ``32760x12x128`` is Wan2.1-1.3B's whole self-attention at 480p x 81 frames (12 heads),
the GPU-sized version of the one-head CPU case; ``--dtype bf16`` is how Wan is served.

    python packages/liteboost/benchmarks/sparse_attention.py --out DIR [--rounds N] [--cases ...]
    python packages/liteboost/benchmarks/sparse_attention.py --out DIR --device cuda \
        --dtype bf16 --cases 32760x12x128
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from liteboost.ops.block_gather import gather_block_sparse_attention
from liteboost.ops.cpu_extension import load_cpu_kernel
from liteboost.ops.flex import build_block_mask, flex_block_sparse_attention
from liteboost.ops.fused_cpu import fused_cpu_block_sparse_attention
from liteboost.ops.sparse_attention import plan_sparse_attention, sparse_attention
from liteboost.ops.tiling import reorder
from npu_core.bench import BenchTable, Timing

# (grid, heads, head_dim): S = 4096, 8192 (head dim 64 and 128), 16384, all with 4-8 heads, then
# one head of Wan2.1 480p (81 frames: 21 x 30 x 52 = 32760 tokens, tiles with remainder rows and
# columns, head dim 128; dense SDPA costs 3-4 s per head there on 2 CPU cores).
CASES = [
    ((4, 32, 32), 8, 64),
    ((8, 32, 32), 4, 64),
    ((8, 32, 32), 4, 128),
    ((16, 32, 32), 4, 64),
    ((21, 30, 52), 1, 128),
]
SPARSITIES = [0.5, 0.8, 0.9]
FLEX_SPARSITY = 0.8
BLOCK = 128
# Only when named in --cases (too long for the CPU default run).
EXTRA_CASES = [((21, 30, 52), 12, 128)]
CPU = torch.device("cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _label(grid, heads, dim) -> str:
    return f"{grid[0] * grid[1] * grid[2]}x{heads}x{dim}"


def _time(fn, device: torch.device = CPU) -> float:
    """Wall seconds of one call; on an accelerator its queued kernels are waited for."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def attention_case(
    grid,
    heads: int,
    dim: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """The shared setup of this script and ``sparsity_zero.py``: seeded q, k, v
    [1, heads, prod(grid), dim] (fp32 by default; drawn on CPU, then moved) and the dense SDPA
    call every variant is compared with."""
    seq = grid[0] * grid[1] * grid[2]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen).to(device, dtype) for _ in range(3))

    def dense():
        return F.scaled_dot_product_attention(q, k, v)

    return q, k, v, dense


def interleaved_rounds(
    jobs: dict, rounds: int, device: torch.device = CPU
) -> dict[str, list[float]]:
    """Seconds per call of every job, ``rounds`` rounds, the order rotating each round."""
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    names = list(jobs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_time(jobs[name], device))
    return samples


def run_case(
    grid,
    heads,
    dim,
    rounds: int,
    table: BenchTable,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> None:
    seq = grid[0] * grid[1] * grid[2]
    q, k, v, dense = attention_case(grid, heads, dim, device, dtype)
    on_cpu = device.type == "cpu"

    def full(s):
        return lambda: sparse_attention(q, k, v, latent_shape=grid, sparsity=s, block_size=BLOCK)

    plans = {
        s: plan_sparse_attention(q, k, latent_shape=grid, sparsity=s, block_size=BLOCK)
        for s in SPARSITIES
    }
    tiled = {
        s: [reorder(t, plans[s].layout, 2).contiguous() for t in (q, k, v)] for s in SPARSITIES
    }
    mask = build_block_mask(plans[FLEX_SPARSITY].block_index, BLOCK, (seq, seq))

    def flex():
        return flex_block_sparse_attention(*tiled[FLEX_SPARSITY], None, BLOCK, block_mask=mask)

    def gather(s):
        return lambda: gather_block_sparse_attention(*tiled[s], plans[s].block_index, BLOCK)

    def fused(s):
        return lambda: fused_cpu_block_sparse_attention(*tiled[s], plans[s].block_index, BLOCK)

    compile_s = _time(flex, device)  # first call of this shape compiles
    equal_at_zero = torch.equal(
        sparse_attention(q, k, v, latent_shape=grid, sparsity=0.0, block_size=BLOCK), dense()
    )

    def planning(s):
        return lambda: plan_sparse_attention(q, k, latent_shape=grid, sparsity=s, block_size=BLOCK)

    jobs = {"dense": dense, "flex": flex}
    for s in SPARSITIES:
        jobs[f"full{s}"] = full(s)
        if on_cpu:  # the fused C++ kernel is CPU-only
            jobs[f"fused{s}"] = fused(s)
        jobs[f"gather{s}"] = gather(s)
        jobs[f"plan{s}"] = planning(s)
    for fn in jobs.values():  # warm-up
        fn()
    _sync(device)
    samples = interleaved_rounds(jobs, rounds, device)
    dense_t = Timing(samples["dense"])
    table.add(
        S=seq,
        heads=heads,
        head_dim=dim,
        sparsity=0.0,
        dense_ms=dense_t.median * 1e3,
        sparse_ms=dense_t.median * 1e3,
        speedup=1.0,
        fused_speedup=1.0,
        gather_speedup=1.0,
        flex_speedup=1.0,
        plan_ms=0.0,
        compile_s=0.0,
        note=f"sdpa fallback, identical output: {equal_at_zero}",
    )
    for s in SPARSITIES:
        full_t, gather_t, plan_t = (Timing(samples[f"{p}{s}"]) for p in ("full", "gather", "plan"))
        fused_t = Timing(samples[f"fused{s}"]) if on_cpu else None
        flex_t = Timing(samples["flex"]) if s == FLEX_SPARSITY else None
        table.add(
            S=seq,
            heads=heads,
            head_dim=dim,
            sparsity=s,
            dense_ms=dense_t.median * 1e3,
            sparse_ms=full_t.median * 1e3,
            speedup=dense_t.median / full_t.median,
            fused_speedup=dense_t.median / fused_t.median if fused_t else None,
            gather_speedup=dense_t.median / gather_t.median,
            flex_speedup=dense_t.median / flex_t.median if flex_t else None,
            plan_ms=plan_t.median * 1e3,
            compile_s=compile_s if flex_t else None,
            note=f"keep {plans[s].keep} blocks",
        )
    print(table.to_markdown(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for sparse_attention.{json,md}")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per case")
    labels = [_label(grid, heads, dim) for grid, heads, dim in CASES]
    extra = [_label(grid, heads, dim) for grid, heads, dim in EXTRA_CASES]
    parser.add_argument(
        "--cases",
        default="",
        help=f"comma-separated subset of {','.join(labels)} (tokens x heads x head dim; "
        f"default: all of these), for a shorter run, or {','.join(extra)} (only when named)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    chosen = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(chosen) - set(labels) - set(extra))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {labels + extra}")
    # The fused kernel compiles on a machine's first run, else loads the cache; CPU only.
    build_s = _time(load_cpu_kernel) if device.type == "cpu" else None
    table = BenchTable(
        f"Block-sparse attention vs dense SDPA ({device.type}, {args.dtype}, batch 1, block 128)",
        [
            "S",
            "heads",
            "head_dim",
            "sparsity",
            "dense_ms",
            "sparse_ms",
            "speedup",
            "fused_speedup",
            "gather_speedup",
            "flex_speedup",
            "plan_ms",
            "compile_s",
            "note",
        ],
        {
            "rounds": args.rounds,
            "cases": chosen or labels,
            "block_size": BLOCK,
            "threads": torch.get_num_threads(),
            "speedup": "dense / (plan + reorder + fused kernel + restore), medians",
            "fused_speedup": "dense / fused C++ kernel alone (the CPU default)",
            "gather_speedup": "dense / block-gather kernel alone (fallback, autograd path)",
            "flex_speedup": f"dense / FlexAttention kernel alone at sparsity {FLEX_SPARSITY}",
            "fused_kernel_build_or_load_s": None if build_s is None else round(build_s, 1),
            "device": device.type,
            "dtype": args.dtype,
            "clock": "wall" + (", device synchronised" if device.type != "cpu" else ""),
        },
    )
    for grid, heads, dim in CASES + EXTRA_CASES:
        label = _label(grid, heads, dim)
        if (chosen and label not in chosen) or (not chosen and label in extra):
            continue
        rounds = args.rounds if grid[0] < 16 or device.type != "cpu" else max(3, args.rounds - 2)
        run_case(grid, heads, dim, rounds, table, device, DTYPES[args.dtype])
    table.write(args.out, "sparse_attention")


if __name__ == "__main__":
    main()
