"""``modelzoo train CARD --full-size`` on 2 local ranks, its summary kept as a result file.

Usage: python packages/modelzoo/benchmarks/full_size_train.py --out DIR [--card qwen3-0.6b]
    [--layers N] [--steps 20] [--seq-len 256] [--batch-size 1] [--mesh fsdp] [--dtype fp32]
    [--name NAME]

The run is exactly the command's (``torchmind_modelzoo.training.train`` with ``--full-size``, its
checks, its ranks, its final checkpoint, in a temporary out-dir): the card's published config,
random weights, bytes as tokens. The row gives the summary's medians over the steps after the
first (tokens/s, forward + backward ms, optimizer ms, each rank's peak memory) and the first and
last training loss; the metadata holds the machine's load average before and after, since the
machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from npu_core.bench import BenchTable
from torchmind_modelzoo import registry
from torchmind_modelzoo.env import force_offline
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.training import train

force_offline()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for NAME.{json,md}")
    parser.add_argument("--card", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1, help="samples per rank per step")
    parser.add_argument("--mesh", default="fsdp")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--name", default=None, help="result file name (default: the card's)")
    args = parser.parse_args()
    card = registry.get(args.card)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="full-size-train-") as tmp:
        job = {
            "steps": args.steps,
            "out_dir": tmp,
            "parallel": {"nproc": 2, "mesh": args.mesh},
            "dtype": args.dtype,
            "data": {"seq_len": args.seq_len, "batch_size": args.batch_size},
        }
        options = TrainOptions(full_size=True, layers=args.layers, job=job)
        summary = train(card, options, overwrite=True, progress=False)
    load_after = os.getloadavg()
    medians = summary["step_medians"]
    layers = card.config.get("num_hidden_layers") if card.config else None
    kept = layers if args.layers is None else args.layers
    table = BenchTable(
        f"modelzoo train {card.id} --full-size, 2 CPU ranks ({args.mesh}), "
        f"medians of steps {medians['steps']}",
        [
            "card",
            "layers",
            "mesh",
            "dtype",
            "tokens / step",
            "tokens/s",
            "forward+backward ms",
            "optimizer ms",
            "peak MiB rank 0",
            "peak MiB rank 1",
            "first loss",
            "last loss",
        ],
        metadata={
            "steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size_per_rank": args.batch_size,
            "published_layers": layers,
            "seconds": summary["seconds"],
            "load_average_1_5_15_before": [round(x, 2) for x in load_before],
            "load_average_1_5_15_after": [round(x, 2) for x in load_after],
        },
    )
    table.add(
        card=card.id,
        layers=f"{kept} of {layers}",
        mesh=args.mesh,
        dtype=args.dtype,
        **{
            "tokens / step": 2 * args.batch_size * args.seq_len,
            "tokens/s": medians["tokens_per_s"],
            "forward+backward ms": medians["backward_ms"],
            "optimizer ms": medians["optim_ms"],
            "peak MiB rank 0": medians["peak_memory_mb"][0],
            "peak MiB rank 1": medians["peak_memory_mb"][1],
            "first loss": summary["losses"][0],
            "last loss": summary["losses"][-1],
        },
    )
    _, md_path = table.write(args.out, args.name or f"full_size_train_{card.id}")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
