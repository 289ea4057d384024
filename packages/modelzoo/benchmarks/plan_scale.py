"""The planner's scale table and plot: two cards at their published size, 64 to 16,384 ranks.

Usage: python packages/modelzoo/benchmarks/plan_scale.py --out DIR [--plot FILE] [--device h100]

For deepseek-v3.2 and qwen3-30b-a3b-instruct-2507, two meshes per world size (64, 1,024, 16,384):
the worst rank's memory, the bytes per step of each collective on its mesh dimension,
Newton-Schulz max / mean over ranks under hyperparallel's owner assignment, gather-all Muon and
a one-matrix-per-rank all-to-all scheme, and the step estimate. The plot: qwen3-30b-a3b's
worst-rank peak memory and step estimate against the world size on one mesh family
(pp=16 x dp_shard). Nothing runs on a device: every number is the planner's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.planner import Plan, make_plan
from hyperparallel.plan.profiles import load_profile
from hyperparallel.plan.report import flops, seconds, size
from npu_core.bench import command_line, machine_line
from torchmind_modelzoo import registry, training
from torchmind_modelzoo.env import force_offline
from torchmind_modelzoo.options import TrainOptions

force_offline()

JOB = {
    "data": {"seq_len": 4096, "batch_size": 8},
    "parallel": {"microbatches": 8},
    "activation": {"policy": "recompute"},
}
"""Per data-parallel rank 8 samples of 4,096 tokens (8 micro-batches under pp), every block
recomputed: a long-context pre-training step."""

MESHES = {
    "deepseek-v3.2": {
        64: ["pp=8,ep=8", "pp=4,ep=16"],
        1024: ["pp=4,ep=256", "pp=8,ep=8,dp_shard=16"],
        16384: ["pp=16,dp_shard=1024", "pp=16,dp_replicate=4,ep=16,dp_shard=16"],
    },
    "qwen3-30b-a3b-instruct-2507": {
        64: ["ep=64", "ep=8,dp_shard=8"],
        1024: ["pp=8,ep=128", "dp_replicate=8,ep=8,dp_shard=16"],
        16384: ["pp=16,dp_shard=1024", "pp=16,dp_replicate=8,ep=8,dp_shard=16"],
    },
}
"""Per card and world size: one mesh without expert parallelism inside FSDP groups (pp x ep, or
pp x FSDP), and one with it."""

PLOT_CARD = "qwen3-30b-a3b-instruct-2507"
PLOT_WORLDS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def plot_mesh(world: int) -> str:
    """The plot's mesh family: 16 pipeline stages, FSDP over the rest (experts sharded on E with
    the dense weights), a layout that exists at every world size of the plot."""
    return f"pp=16,dp_shard={world // 16}"


def plan_card(card_id: str, world: int, mesh: str, device: str) -> Plan:
    card = registry.get(card_id)
    job = {**JOB, "parallel": {**JOB["parallel"], "mesh": mesh}}
    options = TrainOptions(full_size=True, job=job)
    with tempfile.TemporaryDirectory() as folder:
        model = training.write_model_config(card, options, Path(folder))
        cfg = training.train_config(card, options, model)
        return make_plan(cfg, parse_mesh(mesh, world), load_profile(device))


def row(card_id: str, plan: Plan) -> dict[str, Any]:
    worst = plan.worst
    collectives: dict[str, int] = {}
    for c in plan.collectives.get(worst.rank, []):
        key = f"{c.source} {c.kind} ({c.dim})"
        collectives[key] = collectives.get(key, 0) + c.bytes
    return {
        "card": card_id,
        "world": plan.inventory.dims.world_size,
        "mesh": plan.inventory.dims.spec(),
        "worst_rank": worst.rank,
        "params": worst.params,
        "grads": worst.grads,
        "optimizer": worst.optimizer,
        "activations_peak_device": worst.activations_peak.device,
        "transient": worst.transient,
        "peak": worst.peak,
        "collectives": collectives,
        "ns": {
            scheme: {"max_flops": w.max_flops, "mean_flops": w.mean_flops, "balance": w.balance}
            for scheme, w in plan.ns.items()
        },
        "step_s": plan.step_seconds,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| card | world | mesh | worst-rank memory: params / grads / optimizer / activations / "
        "transient = peak | bytes per step on the worst rank | NS max/mean: hyperparallel | "
        "gather-all | all-to-all | NS max per rank (hyperparallel, gather-all) | step estimate |",
        "|---|---:|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        memory = " / ".join(
            size(r[k])
            for k in ("params", "grads", "optimizer", "activations_peak_device", "transient")
        )
        moved = "<br>".join(f"{k}: {size(v)}" for k, v in sorted(r["collectives"].items()))
        ns = r["ns"]
        lines.append(
            f"| {r['card']} | {r['world']} | `{r['mesh']}` | {memory} = **{size(r['peak'])}** | "
            f"{moved} | {ns['hyperparallel']['balance']:.2f} | {ns['gather-all']['balance']:.2f} | "
            f"{ns['all-to-all']['balance']:.2f} | {flops(ns['hyperparallel']['max_flops'])}, "
            f"{flops(ns['gather-all']['max_flops'])} | {seconds(r['step_s'] or 0.0)} |"
        )
    return "\n".join(lines) + "\n"


def plot(points: list[tuple[int, float, float]], path: Path, device: str) -> None:
    worlds = [w for w, _, _ in points]
    fig, memory_axis = plt.subplots(figsize=(7, 4))
    memory_axis.plot(worlds, [p / 2**30 for _, p, _ in points], "o-", color="tab:blue")
    memory_axis.set_ylim(bottom=0)
    memory_axis.set_xscale("log", base=2)
    memory_axis.set_xlabel("world size (ranks)")
    memory_axis.set_ylabel("worst-rank peak memory (GiB)", color="tab:blue")
    time_axis = memory_axis.twinx()
    time_axis.plot(worlds, [s for _, _, s in points], "s--", color="tab:red")
    time_axis.set_ylim(bottom=0)
    time_axis.set_ylabel(f"step estimate on {device} (s)", color="tab:red")
    memory_axis.set_title(
        f"{PLOT_CARD}: 8 x 4,096 tokens per data-parallel rank, recompute\n"
        "mesh pp=16 x dp_shard=world/16"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the JSON and table.")
    parser.add_argument("--plot", type=Path, help="PNG of memory and step time vs world size.")
    parser.add_argument("--device", default="h100", help="Device profile of the estimate.")
    args = parser.parse_args()
    rows = []
    for card_id, worlds in MESHES.items():
        for world, meshes in worlds.items():
            for mesh in meshes:
                rows.append(row(card_id, plan_card(card_id, world, mesh, args.device)))
                print(card_id, world, mesh, size(rows[-1]["peak"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = {"machine": machine_line(), "command": command_line(), "device": args.device}
    (args.out / "plan_scale.json").write_text(json.dumps({**stamp, "rows": rows}, indent=1))
    header = f"Command: `{stamp['command']}`\n\nPlanned on: {stamp['machine']}\n\n"
    (args.out / "plan_scale.md").write_text(header + markdown(rows))
    if args.plot is not None:
        points = []
        for world in PLOT_WORLDS:
            plan = plan_card(PLOT_CARD, world, plot_mesh(world), args.device)
            points.append((world, float(plan.worst.peak), plan.step_seconds or 0.0))
        plot(points, args.plot, load_profile(args.device).name)
        (args.out / "plan_scale_plot.json").write_text(json.dumps(points))


if __name__ == "__main__":
    main()
