"""Benchmark: one Muon optimizer step on FSDP2 parameters, 4 CPU ranks, three ways.

(a) torch.optim.Muon on the DTensor parameters (its matmuls redistribute implicitly);
(b) the common workaround: every rank gathers every whole matrix (``full_tensor()``), runs NS on
    all of them, and keeps its own rows;
(c) hyperparallel Muon: each matrix orthogonalised once in the job, packed gathers, overlap.
Plus a batched-NS micro-benchmark: the strategy ``orthogonalize`` picks versus a plain loop, and
the mesh layouts (FSDP 4, HSDP 2x2, ep=2 x dp_shard=2): NS FLOPs per rank against an even share,
and the step with the scatter / replica sums overlapped with NS or waited for at once.
Newton-Schulz computes in the dtype ``ns_dtype="auto"`` picks on the machine (bf16 where bf16
GEMMs are native, fp32 elsewhere); torch.optim.Muon always computes in bf16. Run it once as is and
once with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` to see an AVX2-only CPU.

Run: ``uv run nox -s bench`` or ``uv run python packages/hyperparallel/benchmarks/muon_step.py
--out DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hyperparallel.optim import Muon
from hyperparallel.optim import newton_schulz as ns
from hyperparallel.optim.distributed import ShardedNewtonSchulz
from hyperparallel.optim.plan import shard_rows
from hyperparallel.parallel.mesh import ParallelDims
from npu_core.bench import BenchTable, compare
from npu_core.dist import launch
from npu_core.memory import memory_stats, reset_peak_memory_stats

WORLD = 4
STEPS_NS = 5
REPEATS = 7


class MixedModel(nn.Module):
    """Hidden matrices of several shapes (rows not all divisible by 4) and optional experts."""

    def __init__(self, experts: bool) -> None:
        super().__init__()
        shapes = [(256, 256)] * 6 + [(512, 128)] * 3 + [(128, 512)] * 3 + [(96, 250)] * 4
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in shapes)
        if experts:
            self.experts = nn.ParameterList(
                nn.Parameter(torch.randn(8, 128, 256) * 0.02) for _ in range(2)
            )


def _ns_flops(rows: int, cols: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return STEPS_NS * (4 * m * m * n + 2 * m**3)


class _GatherEverything:
    """Workaround (b) as a Muon engine: whole matrices everywhere, NS everywhere, keep own rows."""

    def __init__(self, opt: Muon) -> None:
        self.opt, self.matrices = opt, 0

    def __call__(self, updates: list[DTensor], params: list[DTensor]) -> list[DTensor]:
        full = [u.full_tensor() for u in updates]
        flat = [f if f.ndim == 3 else f.reshape(f.shape[0], -1) for f in full]
        self.matrices += sum(f.shape[0] if f.ndim == 3 else 1 for f in flat)
        outs = self.opt.orthogonalize_matrices(flat)
        results = []
        for u, out in zip(updates, outs, strict=True):
            rank = u.device_mesh.get_local_rank(u.device_mesh.ndim - 1)
            splits = shard_rows(u.shape[0], u.device_mesh.size(u.device_mesh.ndim - 1))
            start = sum(splits[:rank])
            local = out.reshape(u.shape)[start : start + splits[rank]]
            results.append(
                DTensor.from_local(
                    local,
                    u.device_mesh,
                    u.placements,
                    run_check=False,
                    shape=u.shape,
                    stride=u.stride(),
                )
            )
        return results


def _rank(experts: bool) -> dict:
    torch.manual_seed(0)
    model = MixedModel(experts)
    fully_shard(model, mesh=ParallelDims(dp_shard=WORLD).build("cpu").dense)
    params = list(model.parameters())
    grads = [distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements) for p in params]
    variants = {"hyperparallel": Muon(params, lr=0.02), "gather-all": Muon(params, lr=0.02)}
    gather_all = _GatherEverything(variants["gather-all"])
    variants["gather-all"]._engine = gather_all
    if not experts:  # torch.optim.Muon accepts 2-D parameters only
        variants["torch.optim.Muon"] = torch.optim.Muon(params, lr=0.02, adjust_lr_fn="original")
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, float] = {}
    for repeat in range(REPEATS + 1):
        for name, opt in variants.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            dist.barrier()
            reset_peak_memory_stats("cpu")
            before = memory_stats("cpu").allocated_bytes
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            extra = memory_stats("cpu").peak_allocated_bytes - before
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat:  # the first round builds plans and picks NS strategies
                times[name].append(elapsed.item())
                peaks[name] = max(peaks.get(name, 0), extra)
    engine = variants["hyperparallel"]._engine
    shapes = {i: (p.shape[0], p[0].numel()) for i, p in enumerate(params) if p.ndim == 2}
    plan = next(iter(engine._plans.values()))
    mine = [a.index for a in plan.assignments if a.owner == dist.get_rank()]
    expert_rows = [(i, p) for i, p in enumerate(params) if p.ndim == 3]
    local_experts = sum(p.to_local().shape[0] for _, p in expert_rows)
    flops_c = sum(_ns_flops(*shapes[i]) for i in mine) + sum(
        p.to_local().shape[0] * _ns_flops(p.shape[1], p.shape[2]) for _, p in expert_rows
    )
    total = sum(_ns_flops(*s) for s in shapes.values()) + sum(
        p.shape[0] * _ns_flops(p.shape[1], p.shape[2]) for _, p in expert_rows
    )
    return {
        "ns_dtype": str(ns.resolve_ns_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
        "times": {k: statistics.median(v) for k, v in times.items()},
        "peak_mb": {k: v / 2**20 for k, v in peaks.items()},
        "ns_matrices_c": len(mine) + local_experts,
        "ns_matrices_b": gather_all.matrices // (REPEATS + 1),
        "flops_c": flops_c,
        "flops_total": total,
    }


def _step_table() -> BenchTable:
    table = BenchTable(
        f"Muon optimizer step on FSDP2, {WORLD} CPU ranks (median of {REPEATS}, slowest rank)",
        [
            "model",
            "variant",
            "NS dtype",
            "step (ms)",
            "speedup vs gather-all",
            "speedup vs torch",
            "NS matrices / rank",
            "NS GFLOP / rank (max)",
            "max / (total / world)",
            "peak extra MB (max rank)",
        ],
    )
    for experts in (False, True):
        ranks = launch(_rank, WORLD, experts, timeout=1200)
        label = "matrices + experts" if experts else "matrices"
        times = ranks[0]["times"]
        for name, seconds in times.items():
            row = {
                "model": label,
                "variant": name,
                "NS dtype": "bfloat16" if name == "torch.optim.Muon" else ranks[0]["ns_dtype"],
                "step (ms)": seconds * 1e3,
                "speedup vs gather-all": times["gather-all"] / seconds,
                "speedup vs torch": times["torch.optim.Muon"] / seconds
                if "torch.optim.Muon" in times
                else None,
                "peak extra MB (max rank)": max(r["peak_mb"][name] for r in ranks),
            }
            if name == "hyperparallel":
                flops = max(r["flops_c"] for r in ranks)
                row["NS matrices / rank"] = max(r["ns_matrices_c"] for r in ranks)
                row["NS GFLOP / rank (max)"] = flops / 1e9
                row["max / (total / world)"] = flops / (ranks[0]["flops_total"] / WORLD)
            elif name == "gather-all":
                row["NS matrices / rank"] = ranks[0]["ns_matrices_b"]
                row["NS GFLOP / rank (max)"] = ranks[0]["flops_total"] / 1e9
                row["max / (total / world)"] = float(WORLD)
            table.add(**row)
    return table


# layout -> (mesh shape, mesh dim names, dense placements, expert placements)
LAYOUTS = {
    "fsdp 4": ((4,), ("dp_shard",), [Shard(0)], [Shard(0)]),
    "hsdp 2x2": (
        (2, 2),
        ("dp_replicate", "dp_shard"),
        [Replicate(), Shard(0)],
        [Replicate(), Shard(0)],
    ),
    "ep=2 x dp_shard=2": (
        (2, 2),
        ("ep", "dp_shard"),
        [Replicate(), Shard(0)],
        [Shard(0), Shard(0)],
    ),
}
LAYOUT_BATCH_BYTES = 2**18
"""Small communication batches (256 KiB of whole matrices per owner), so that there are several
batches whose communication can overlap NS."""


def _layout_rank(layout: str) -> dict:
    shape, names, dense, experts = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = MixedModel(experts=True)
    params = [
        nn.Parameter(distribute_tensor(p.detach(), mesh, experts if p.ndim == 3 else dense))
        for p in model.parameters()
    ]
    grads = [distribute_tensor(torch.randn(p.shape), mesh, p.placements) for p in params]
    flops = [0, 0]  # all NS this rank ran, and the expert part of it

    variants = {}
    for name, overlap in (("scatter overlapped", True), ("scatter waited", False)):
        opt = Muon(params, lr=0.02)

        def counted(matrices, opt=opt, overlap=overlap):
            if overlap:  # count one variant's work: both do the same
                for m in matrices:
                    count = m.shape[0] if m.ndim == 3 else 1
                    flops[0] += count * _ns_flops(m.shape[-2], m.shape[-1])
                    flops[1] += count * _ns_flops(m.shape[-2], m.shape[-1]) if m.ndim == 3 else 0
            return opt.orthogonalize_matrices(matrices)

        opt._engine = ShardedNewtonSchulz(counted, batch_bytes=LAYOUT_BATCH_BYTES, overlap=overlap)
        variants[name] = opt
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(REPEATS + 1):
        for name, opt in variants.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat:
                times[name].append(elapsed.item())
        if repeat == 0:
            first_step_flops, expert_flops = flops
    total = sum(
        (p.shape[0] if p.ndim == 3 else 1) * _ns_flops(p.shape[-2], p.shape[-1]) for p in params
    )
    engine = variants["scatter overlapped"]._engine
    # Before 0.3.0 every rank orthogonalised all its local experts (each replica the same ones).
    local_experts = sum(
        p.to_local().shape[0] * _ns_flops(p.shape[-2], p.shape[-1]) for p in params if p.ndim == 3
    )
    return {
        "times": times,
        "flops": first_step_flops,
        "flops_before": first_step_flops - expert_flops + local_experts,
        "total": total,
        "batches": max(len(plan.batches) for plan in engine._plans.values()),
    }


def _layout_table() -> BenchTable:
    table = BenchTable(
        f"Muon step over mesh layouts, {WORLD} CPU ranks, dense + experts model (median of "
        f"{REPEATS}, slowest rank)",
        [
            "layout",
            "NS GFLOP / rank (max)",
            "max / (total / world)",
            "same, experts per replica (before 0.3.0)",
            "comm batches",
            "step ms, scatter waited",
            "step ms, scatter overlapped",
            "waited / overlapped",
        ],
    )
    for layout in LAYOUTS:
        ranks = launch(_layout_rank, WORLD, layout, timeout=1200)
        times = ranks[0]["times"]
        waited, overlapped = times["scatter waited"], times["scatter overlapped"]
        ratios = [w / o for w, o in zip(waited, overlapped, strict=True)]
        flops = max(r["flops"] for r in ranks)
        table.add(
            layout=layout,
            **{
                "NS GFLOP / rank (max)": flops / 1e9,
                "max / (total / world)": flops / (ranks[0]["total"] / WORLD),
                # ep layouts were refused before 0.3.0 (expert placements on two dims)
                "same, experts per replica (before 0.3.0)": None
                if layout.startswith("ep")
                else max(r["flops_before"] for r in ranks) / (ranks[0]["total"] / WORLD),
                "comm batches": ranks[0]["batches"],
                "step ms, scatter waited": statistics.median(waited) * 1e3,
                "step ms, scatter overlapped": statistics.median(overlapped) * 1e3,
                "waited / overlapped": statistics.median(ratios),
            },
        )
    return table


def _batching_table() -> BenchTable:
    table = BenchTable(
        "Batched Newton-Schulz on one CPU process: chosen strategy versus a plain loop",
        ["matrices", "dtype", "NS dtype", "loop (ms)", "batched (ms)", "auto (ms)", "auto / loop"],
    )
    ns_dtype = str(ns.resolve_ns_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    keller = ns.resolve_coefficients("keller", STEPS_NS)
    for count, shape in ((74, (24, 10240)), (200, (64, 64))):
        mats = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(count)]
        run = {
            s: (lambda s=s, mats=mats: ns.orthogonalize(mats, keller, strategy=s))
            for s in ("loop", "batched", "auto")
        }
        run["auto"]()  # decide once, as a training run would
        loop_vs_auto = compare(run["loop"], run["auto"], warmup=1, repeats=5)
        batched = compare(run["loop"], run["batched"], warmup=1, repeats=5)
        table.add(
            matrices=f"{count} x {list(shape)}",
            dtype="bf16",
            **{
                "NS dtype": ns_dtype,
                "loop (ms)": loop_vs_auto.baseline.median * 1e3,
                "batched (ms)": batched.candidate.median * 1e3,
                "auto (ms)": loop_vs_auto.candidate.median * 1e3,
                "auto / loop": 1 / loop_vs_auto.ratio_median,
            },
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/hyperparallel", help="Output folder.")
    tables = {
        "muon_step": _step_table,
        "ns_batching": _batching_table,
        "muon_layouts": _layout_table,
    }
    parser.add_argument(
        "--tables", nargs="+", choices=list(tables), default=list(tables), help="Tables to run."
    )
    args = parser.parse_args()
    for name in args.tables:
        table = tables[name]()
        table.write(args.out, name)
        print(table.to_markdown())


if __name__ == "__main__":
    main()
