"""Tiny convert + run cost per full card, and exported program vs eager forward, side by side.

Usage: python packages/modelzoo/benchmarks/convert_run.py --out DIR [--cards a,b] [--repeats N]

For every full card: wall time of ``convert --tiny`` (build, torch.export, eager check, save)
and of ``run --tiny`` (build + example), then the example's forward timed eager against the
exported program (``ExportedProgram.module()``) in interleaved repeats. The ratio eager /
exported says what export alone buys (or costs) on this device before any compiler runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from rich.progress import track

from npu_core.bench import BenchTable, compare
from torchmind_modelzoo import registry
from torchmind_modelzoo.build import build_model
from torchmind_modelzoo.convert import convert
from torchmind_modelzoo.env import force_offline
from torchmind_modelzoo.examples.base import ExportWrapper, example_for
from torchmind_modelzoo.runner import run

force_offline()  # modelzoo imports transformers / diffusers only when it builds a model


def bench_card(name: str, repeats: int) -> dict:
    card = registry.get(name)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        convert(card, tmp, tiny=True)
        convert_s = time.perf_counter() - start
        program = (
            torch.export.load(os.path.join(tmp, "model.pt2"))
            if card.convert.method == ("export")
            else None
        )
    start = time.perf_counter()
    run(card, tiny=True)
    run_s = time.perf_counter() - start
    row = {
        "card": name,
        "task": card.example.task.value,
        "convert s": round(convert_s, 2),
        "run s": round(run_s, 2),
    }
    if program is not None:
        model = build_model(card, tiny=True)
        example = example_for(card)
        inputs = example.inputs(model)
        eager = ExportWrapper(example, model).eval()
        exported = program.module(check_guards=False)
        with torch.no_grad():
            cmp = compare(lambda: eager(**inputs), lambda: exported(**inputs), repeats=repeats)
        row |= {
            "eager ms": round(cmp.baseline.median * 1e3, 3),
            "exported ms": round(cmp.candidate.median * 1e3, 3),
            "eager / exported": round(cmp.speedup, 2),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for convert_run.{json,md}")
    parser.add_argument("--cards", default="", help="comma-separated card ids (default: all full)")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved forward repeats")
    args = parser.parse_args()
    names = args.cards.split(",") if args.cards else [c.id for c in registry.list(status="full")]
    table = BenchTable(
        "modelzoo: tiny convert + run per full card, eager vs exported forward",
        ["card", "task", "convert s", "run s", "eager ms", "exported ms", "eager / exported"],
        {"repeats": args.repeats, "cards": len(names), "tiny": True, "dtype": "float32"},
    )
    # Untimed warm-up: the first conversion also pays library imports and export's start-up.
    with tempfile.TemporaryDirectory() as tmp:
        convert(registry.get(names[0]), tmp, tiny=True)
    for name in track(names, description="cards"):
        table.add(**bench_card(name, args.repeats))
    _, md_path = table.write(args.out, "convert_run")
    print(md_path.read_text())


if __name__ == "__main__":
    main()
