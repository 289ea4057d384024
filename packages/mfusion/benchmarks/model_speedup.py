"""Eager vs torch.compile (Inductor) vs torch.compile + mfusion on seven small models.

Measured as TorchBench does: warm-ups, interleaved repeats, medians; speedup = eager median /
compiled median; an accuracy gate against eager fp32; compile time and fusions applied.

Noise control. One forward of these models takes 1-5 ms, so a single call per sample is at the
mercy of every scheduler tick. Each sample therefore times a batch of calls (calibrated to about
``--sample-ms``), rounds alternate the order of the two sides, the ratio is the median of
per-round ratios, the garbage collector is paused while timing, and the torch thread count is
fixed (one by default: on a shared 2-core machine a second OpenMP thread mostly measures the
neighbours). An A/A control row compiles the model a second time through the same mfusion
options path with every pass off: its graph is identical to plain Inductor's but it is compiled
and loaded separately, so its ratio is the noise floor of the run (it should be 1.00).

    python packages/mfusion/benchmarks/model_speedup.py --out bench-results/mfusion

Which rewrites run depends on the machine (``matmul_cast`` needs native bf16 GEMMs, ``patch_conv``
rewrites only shape classes measured on this ISA level): the tables record mfusion's machine
profile next to npu_core's environment block, so a table says which machine it came from.
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
from mfusion.machine import MachineProfile
from npu_core.bench import BenchTable, Timing, calls_per_sample, compare, measure

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
        # All variants go through the same options path; only the post-grad pass differs. The
        # control runs the mfusion pass manager with nothing enabled: same graph as plain.
        plain = torch.compile(model, options={"post_grad_custom_post_pass": None})
        control = torch.compile(
            model, options=mfusion.compile_options(backend=args.backend, passes=(), auto_fuse=False)
        )
        fused = torch.compile(
            model,
            options=mfusion.compile_options(backend=args.backend, patch_conv=args.patch_conv),
        )
        out_plain, compile_plain = _compile(lambda: plain(*inputs))
        control(*inputs)
        mfusion.clear_report()
        out_fused, compile_fused = _compile(lambda: fused(*inputs))
        report = mfusion.report()
        calls = calls_per_sample(lambda: plain(*inputs), args.sample_ms, warmup=3)
        eager = measure(lambda: model(*inputs), calls=calls, warmup=1, repeats=args.repeats)
        timed = {"calls": calls, "pause_gc": True, "warmup": args.warmup, "repeats": args.repeats}
        a_a = compare(lambda: plain(*inputs), lambda: control(*inputs), **timed)
        comparison = compare(lambda: plain(*inputs), lambda: fused(*inputs), **timed)
    ratios = Timing(comparison.ratios)  # order statistics of the per-round ratios
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
        # Interquartile range of the per-round ratios: how far one round strays.
        "ratio p25-p75": f"{ratios.p25:.3f}-{ratios.p75:.3f}",
        "A/A control": a_a.ratio_median,
        "calls/sample": calls,
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
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--repeats", type=int, default=41, help="interleaved rounds per model")
    parser.add_argument(
        "--sample-ms", type=float, default=30.0, help="target duration of one timed sample"
    )
    parser.add_argument(
        "--tol", type=float, default=1e-3, help="accuracy gate: max abs error / scale"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument(
        "--patch-conv",
        default="auto",
        choices=["auto", "on", "off"],
        help="patch_conv policy (default auto: only shape classes measured on this ISA level)",
    )
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)

    columns = [
        "model",
        "eager ms",
        "inductor ms",
        "mfusion ms",
        "inductor speedup",
        "mfusion speedup",
        "mfusion / inductor",
        "ratio p25-p75",
        "A/A control",
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
            f"    mfusion/inductor {row['mfusion / inductor']:.3f}x "
            f"(A/A {row['A/A control']:.3f}x), fusions {row['fusions']}, "
            f"accuracy {row['accuracy']}",
            flush=True,
        )
    ratios = [r["mfusion / inductor"] for r in rows if r["transformer"]]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    profile = MachineProfile.detect()
    metadata = {
        "backend": args.backend,
        "patch_conv": args.patch_conv,
        "mfusion machine profile": profile.describe(),
        "mfusion ISA level": profile.isa_level,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "sample ms": args.sample_ms,
        "A/A control range": [
            min(r["A/A control"] for r in rows),
            max(r["A/A control"] for r in rows),
        ],
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
    print(f"mfusion machine profile: {profile.describe()} (ISA level {profile.isa_level})")
    print(
        f"geomean mfusion/inductor over transformer models: {geomean:.3f}x; "
        f"min over all models: {metadata['min mfusion/inductor']:.3f}x"
    )


if __name__ == "__main__":
    main()
