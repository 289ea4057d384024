"""``hyperparallel train`` on 4 local ranks per mesh layout: tokens/s, step and optimizer ms.

Same model, seed and global batch for every layout (the default model with 4 blocks, global batch
16 x 128 tokens, fp32 Newton-Schulz); each layout trains ``--steps`` steps and the median of the
steps after the first two is reported. ``--ablation`` adds the paired-schedule recompute rows:
dualpipev with early recompute (before the paired forward), recompute inside backward, and none.

    uv run python packages/hyperparallel/benchmarks/layouts.py --out DIR [--steps 8] [--ablation]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hyperparallel.train.config import load_config
from hyperparallel.train.presets import default
from hyperparallel.train.trainer import train_rank
from npu_core.bench import machine_line
from npu_core.dist import launch

LAYOUTS = [
    ("fsdp", "fsdp", []),
    ("hsdp", "dp_replicate=2,dp_shard=2", []),
    ("ep", "ep=2,dp_shard=2", []),
    ("pp 1f1b", "pp=2,dp_shard=2", ["parallel.pp_schedule='1f1b'"]),
    ("pp interleaved_1f1b", "pp=2,dp_shard=2", ["parallel.pp_schedule='interleaved_1f1b'"]),
    ("pp dualpipev", "pp=2,dp_shard=2", ["parallel.pp_schedule='dualpipev'"]),
]
ABLATION = [
    ("dualpipev, no recompute", "pp=2,dp_shard=2", ["parallel.pp_schedule='dualpipev'"]),
    (
        "dualpipev, recompute in backward",
        "pp=2,dp_shard=2",
        ["parallel.pp_schedule='dualpipev'", "activation.policy='recompute'"],
    ),
    (
        "dualpipev, early recompute",
        "pp=2,dp_shard=2",
        [
            "parallel.pp_schedule='dualpipev'",
            "activation.policy='recompute'",
            "parallel.pp_early_recompute=true",
        ],
    ),
]


def run(name: str, mesh: str, extra: list[str], out: Path, steps: int) -> dict:
    """Train one layout and summarise its metrics.json."""
    folder = out / name.replace(" ", "_").replace(",", "")
    cfg = load_config(
        default(),
        overrides=[
            f"out_dir={str(folder)!r}",
            f"parallel.mesh={mesh!r}",
            f"steps={steps}",
            "model.n_layers=4",
            "data.global_batch_size=16",
            "parallel.microbatches=4",
            "optim.ns_dtype='fp32'",
            f"eval_every={steps}",
            f"checkpoint_every={steps}",
            *extra,
        ],
    )
    launch(train_rank, 4, cfg, False, backend=None, timeout=3600)
    records = json.loads((folder / "metrics.json").read_text())["train"][2:]
    return {
        "layout": name,
        "mesh": mesh,
        "tokens/s": statistics.median(r["tokens_per_s"] for r in records),
        "forward+backward ms": statistics.median(r["backward_ms"] for r in records),
        "optimizer ms": statistics.median(r["optim_ms"] for r in records),
        "first loss": json.loads((folder / "metrics.json").read_text())["train"][0]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ablation", action="store_true", help="also the recompute ablation")
    parser.add_argument("--only-ablation", action="store_true")
    args = parser.parse_args()
    rows = []
    cases = [] if args.only_ablation else LAYOUTS
    cases = cases + (ABLATION if args.ablation or args.only_ablation else [])
    for name, mesh, extra in cases:
        rows.append(run(name, mesh, extra, args.out, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + f"\n\n{machine_line()}\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layouts.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
