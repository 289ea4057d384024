"""Eager vs torch.compile (Inductor) vs torch.compile + mfusion on seven small models.

Measured as TorchBench does: warm-ups, interleaved repeats, medians; speedup = eager median /
compiled median; an accuracy gate against eager fp32; compile time and fusions applied.

    python packages/mfusion/benchmarks/model_speedup.py --out bench-results/mfusion
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mfusion-bench-"))

from zoo.transformers import Bert, Clip, Llama, Speech, ViT
from zoo.vision import DCGANGenerator, ResNet18

import mfusion
from npu_core.bench import BenchTable, compare, measure

Factory = Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]


def _tokens(batch: int, seq: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


# name -> (factory, is_transformer)
MODELS: dict[str, tuple[Factory, bool]] = {
    "llama_decoder": (lambda: (Llama(), (_tokens(2, 64),)), True),
    "bert_encoder": (lambda: (Bert(), (_tokens(2, 64),)), True),
    "vit": (lambda: (ViT(), (torch.randn(2, 3, 64, 64),)), True),
    "clip_dual_encoder": (
        lambda: (Clip(), (torch.randn(2, 3, 64, 64), _tokens(2, 32))),
        True,
    ),
    "speech_transformer": (lambda: (Speech(), (torch.randn(2, 200, 80),)), True),
    "resnet18": (lambda: (ResNet18(), (torch.randn(2, 3, 64, 64),)), False),
    "dcgan_generator": (lambda: (DCGANGenerator(), (torch.randn(2, 64, 1, 1),)), False),
}


def _accurate(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Max abs error within ``tol`` of the reference's scale (fp32 everywhere)."""
    scale = max(ref.abs().max().item(), 1.0)
    return bool(torch.isfinite(out).all()) and (out - ref).abs().max().item() <= tol * scale


def _compile(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_model(name: str, args: argparse.Namespace) -> dict[str, object]:
    factory, is_transformer = MODELS[name]
    torch.manual_seed(0)
    model, inputs = factory()
    model.eval()
    with torch.no_grad():
        reference = model(*inputs)
        # Both variants go through the same options path; only the post-grad pass differs.
        plain = torch.compile(model, options={"post_grad_custom_post_pass": None})
        fused = torch.compile(model, options=mfusion.compile_options(backend=args.backend))
        out_plain, compile_plain = _compile(lambda: plain(*inputs))
        mfusion.clear_report()
        out_fused, compile_fused = _compile(lambda: fused(*inputs))
        report = mfusion.report()
        eager = measure(lambda: model(*inputs), warmup=args.warmup, repeats=args.repeats)
        comparison = compare(
            lambda: plain(*inputs), lambda: fused(*inputs), warmup=args.warmup, repeats=args.repeats
        )
    accurate = _accurate(out_plain, reference, args.tol) and _accurate(
        out_fused, reference, args.tol
    )
    return {
        "model": name,
        "transformer": is_transformer,
        "eager ms": eager.median * 1e3,
        "inductor ms": comparison.baseline.median * 1e3,
        "mfusion ms": comparison.candidate.median * 1e3,
        "inductor speedup": eager.median / comparison.baseline.median,
        "mfusion speedup": eager.median / comparison.candidate.median,
        # Median of per-round ratios: both sides of a round share the machine's load, so this
        # is far steadier than a ratio of medians on a busy machine.
        "mfusion / inductor": comparison.ratio_median,
        "compile s (inductor)": compile_plain,
        "compile s (mfusion)": compile_fused,
        "graphs": len(report),
        "fusions": report.fusions,
        "accuracy": "pass" if accurate else "FAIL",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for model_speedup.{json,md}")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backend", default="inductor", help="mfusion backend (default inductor)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds per model")
    parser.add_argument(
        "--tol", type=float, default=1e-3, help="accuracy gate: max abs error / scale"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    columns = [
        "model",
        "eager ms",
        "inductor ms",
        "mfusion ms",
        "inductor speedup",
        "mfusion speedup",
        "mfusion / inductor",
        "compile s (inductor)",
        "compile s (mfusion)",
        "fusions",
        "accuracy",
    ]
    rows = []
    for index, name in enumerate(args.models, 1):
        print(f"[{index}/{len(args.models)}] {name} ...", flush=True)
        row = run_model(name, args)
        rows.append(row)
        print(
            f"    mfusion/inductor {row['mfusion / inductor']:.3f}x, fusions {row['fusions']}, "
            f"accuracy {row['accuracy']}",
            flush=True,
        )
    ratios = [r["mfusion / inductor"] for r in rows if r["transformer"]]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    metadata = {
        "backend": args.backend,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "geomean mfusion/inductor (transformers)": geomean,
        "min mfusion/inductor": min(r["mfusion / inductor"] for r in rows),
        "all accurate": all(r["accuracy"] == "pass" for r in rows),
    }
    table = BenchTable(
        "mfusion: eager vs Inductor vs Inductor + mfusion (CPU, fp32)", columns, metadata
    )
    for row in rows:
        table.add(**{c: row[c] for c in columns})
    table.write(args.out, "model_speedup")
    print(table.to_markdown())
    print(
        f"geomean mfusion/inductor over transformer models: {geomean:.3f}x; "
        f"min over all models: {metadata['min mfusion/inductor']:.3f}x"
    )


if __name__ == "__main__":
    main()
