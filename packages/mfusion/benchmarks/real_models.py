"""Inductor vs Inductor + mfusion on real architectures from transformers' and diffusers' own
modeling code: inference and one training step, fp32 and bf16.

    python packages/mfusion/benchmarks/real_models.py --out bench-results/mfusion-real

Models (tiny configs, random weights, see ``zoo/library.py``): BERT, ViT, Whisper, CLIP, Llama,
Qwen3, Mistral, DiT (diffusers), ResNet-18 (transformers), the look-alike DCGAN generator
(no library ships one), and ``llama_eager``: the same Llama with transformers' eager attention
at 512 tokens (the form Inductor's own SDPA patterns miss, which mfusion's ``attention`` takes).
Modes: ``infer-fp32``, ``infer-bf16``, ``train-fp32``, ``train-bf16``.
Inference compiles with ``freezing`` (weights become constants, as Inductor's own CPU dashboard
runs inference; set globally while calling, since Dynamo reads the global flag when tracing);
``--no-freezing`` turns it off. A training step is forward + loss + backward.

Per (model, mode) three compiled variants of the same module: plain Inductor, an A/A control
(mfusion's options path with every pass off: the same graph, compiled separately, so its ratio is
the run's noise floor) and Inductor + mfusion. Timing as in ``model_speedup.py``: one torch
thread, each sample a batch of calls of about ``--sample-ms``, interleaved rounds alternating
order, collector paused, median of per-round ratios with its interquartile range.

Each variant is compiled ``--copies`` times (in the order A B C, C B A, ..., so every variant's
copies sit at the same mean compile position) and its samples take the copies in turn. One
compiled copy can run a few percent faster or slower than another copy of the *same* graph for as
long as the process lives (with freezing each copy owns its constants, and where they land in
memory matters): two copies of ResNet-18's graph read from 0.93x to 1.13x of each other across
processes. With one copy per variant that draw is read as the variant's speed; with several it
is averaged. Each copy compiles a deep copy of the module: Dynamo would hand a second
``torch.compile`` of the same module with equal options the graph it already holds, so before
mfusion 0.4.1 the "copies" of a variant were one compiled graph and averaged nothing. A row now
costs ``3 x --copies`` compiles.

Every row runs in a fresh process of its own (this script again, restricted to the row, with a
fresh Inductor cache), so no row inherits what an earlier one compiled or allocated.
``--processes N`` runs the row in N processes one after the other and pools their rounds: the
ratio columns are the median and quartiles of all rounds, and ``per process`` keeps each
process's own median. Copies average the draw of a compile; only processes average the draw of
a process (ResNet-18's A/A ratio changed sign from one process to the next).

``--device cuda`` runs the same table on a GPU under Inductor/Triton: models and inputs on the
device, every clock read after a device synchronisation, torch's CPU thread count left alone
(``--threads`` is a CPU setting). The bf16 modes are the ones that matter there. mfusion's
CPU-specific passes refuse on the device with a reason; the ``refused`` column names them, the
``rewrites`` column the passes that applied. ``--max-wall-s`` stops starting rows once the next
one would overrun (rows not run are listed as skipped), so a fixed device slot is never exceeded.

Accuracy gate: fp32 outputs (or loss and gradients) within ``--tol`` x max(|reference|, 1) of
eager fp32; bf16 results no further from eager fp32 than twice eager bf16's own error (or the
fp32 bound, whichever is larger), since bf16 rounding is not a compiler's fault.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.eval_frame import OptimizedModule
from zoo.library import MODELS, TrainStep

import mfusion
from mfusion.machine import MachineProfile
from npu_core.bench import BenchTable, Timing, calls_per_sample, compare, measure

MODES = ("infer-fp32", "infer-bf16", "train-fp32", "train-bf16")
OWN_LOSS = {"llama", "qwen3", "mistral", "llama_eager"}
TIME_COLUMNS = (
    "eager ms",
    "inductor ms",
    "mfusion ms",
    "inductor speedup",
    "compile s (inductor)",
    "compile s (mfusion)",
)
ROW_PREFIX = "ROW "


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device, dtype) if t.dtype.is_floating_point else t.to(device)


def _device(name: str) -> torch.device:
    """The benchmark device; refuses one this process cannot use, naming why."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: use cpu or cuda")
    return device


def _sync(device: torch.device) -> Callable[[], None]:
    """What every clock read waits for: the device's queue (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _flat(result: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        return result.detach().float().flatten()
    return torch.cat([t.detach().float().flatten() for t in result])


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return (out - ref).abs().max().item()


class Runner:
    """One (model, mode): builds the module, runs eager references and compiled variants."""

    def __init__(self, name: str, mode: str, args: argparse.Namespace) -> None:
        self.train = mode.startswith("train")
        self.dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float32
        torch.manual_seed(0)  # built on the CPU: the same weights and inputs on every device
        module, inputs = MODELS[name].build(self.train)
        if self.train:
            module = TrainStep(module, own_loss=name in OWN_LOSS).train()
        else:
            module = module.eval()
        device = args.device
        self.reference_module = module.to(device)
        self.reference_inputs = tuple(_cast(t, torch.float32, device) for t in inputs)
        self.module = copy.deepcopy(self.reference_module).to(self.dtype)
        self.inputs = tuple(_cast(t, self.dtype, device) for t in inputs)
        self.freezing = not self.train and args.freezing

    def run(self, fn: Callable[..., torch.Tensor], module: torch.nn.Module | None = None):
        """One call; for a training step the loss and every gradient, else the output.

        ``module`` owns the parameters whose gradients are cleared and returned: by default
        ``fn`` itself (an eager module), the module a compiled copy was built from, or, for a
        :class:`CopyRotation`, that of the copy the call goes to."""
        module = module or _parameter_owner(fn)
        inputs = self.reference_inputs if module is self.reference_module else self.inputs
        if not self.train:
            # Dynamo reads the *global* freezing flag while tracing (parameters become graph
            # attributes only then); freezing passed through torch.compile(options=...) alone
            # reaches Inductor too late and leaves every weight a graph input.
            with torch.no_grad(), inductor_config.patch(freezing=self.freezing):
                return fn(*inputs)
        for p in module.parameters():
            p.grad = None
        loss = fn(*inputs)
        loss.backward()
        return [loss, *(p.grad for p in module.parameters() if p.grad is not None)]

    def compiled(self, options: dict[str, object]) -> Callable[..., torch.Tensor]:
        """A compiled copy of its own: Dynamo hands a second ``torch.compile`` of the *same*
        module with equal options the graph it already compiled (its backend compares equal),
        so every copy compiles a copy of the module (with freezing, its own constants too)."""
        return torch.compile(copy.deepcopy(self.module), options=dict(options))


def _parameter_owner(fn: Callable[..., torch.Tensor]) -> torch.nn.Module:
    if isinstance(fn, CopyRotation):
        fn = fn.next_copy()
    if isinstance(fn, OptimizedModule):
        return fn._orig_mod
    if isinstance(fn, torch.nn.Module):
        return fn
    raise TypeError(f"no module owns the parameters of {fn!r}")


class CopyRotation:
    """Separately compiled copies of one variant that take turns, one timed sample each.

    Called like a compiled module. ``calls`` (the calls in one timed sample) is set once known;
    every ``calls`` consecutive calls go to the same copy, so a sample times one copy and the
    rounds spread evenly over all of them (``compare``'s warmup runs whole samples too).
    """

    def __init__(self, copies: list[Callable[..., torch.Tensor]]) -> None:
        self.copies = copies
        self.calls = 1
        self._count = 0

    def next_copy(self) -> Callable[..., torch.Tensor]:
        """The copy the next call goes to."""
        return self.copies[(self._count // self.calls) % len(self.copies)]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        target = self.next_copy()
        self._count += 1
        return target(*inputs)

    def per_sample(self, calls: int) -> None:
        self.calls, self._count = calls, 0


def run_model(name: str, mode: str, args: argparse.Namespace) -> dict[str, object]:
    torch._dynamo.reset()
    runner = Runner(name, mode, args)
    reference = _flat(runner.run(runner.reference_module, runner.reference_module))
    eager_low = _flat(runner.run(runner.module))
    scale = max(reference.abs().max().item(), 1.0)
    bound = args.tol * scale
    if runner.dtype != torch.float32:
        bound = max(bound, 2 * _error(eager_low, reference))

    sync = _sync(args.device)

    variants = {
        "plain": {"post_grad_custom_post_pass": None},
        "control": mfusion.compile_options(backend=args.backend, passes=(), auto_fuse=False),
        "fused": mfusion.compile_options(backend=args.backend, **args.mfusion),
    }
    rotations = {variant: CopyRotation([]) for variant in variants}
    compile_s: dict[str, float] = {}
    errors = dict.fromkeys(variants, 0.0)
    report = mfusion.report()
    for index in range(args.copies):
        # A B C, C B A, ...: every variant's copies sit at the same mean compile position
        for variant in list(variants) if index % 2 == 0 else reversed(variants):
            compiled = runner.compiled(variants[variant])
            mfusion.clear_report()
            sync()
            start = time.perf_counter()
            out = _flat(runner.run(compiled))  # the first call compiles
            sync()
            if index == 0:
                compile_s[variant] = time.perf_counter() - start
                if variant == "fused":
                    report = mfusion.report()
            errors[variant] = max(errors[variant], _error(out, reference))
            rotations[variant].copies.append(compiled)
    plain, control, fused = rotations["plain"], rotations["control"], rotations["fused"]

    calls = calls_per_sample(lambda: runner.run(plain.copies[0]), args.sample_ms, sync=sync)
    for rotation in (plain, control, fused):
        rotation.per_sample(calls)
    eager = measure(
        lambda: runner.run(runner.module),
        calls=calls,
        warmup=1,
        repeats=args.eager_repeats,
        sync=sync,
    )
    timed = {
        "calls": calls,
        "pause_gc": True,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "sync": sync,
    }
    a_a = compare(lambda: runner.run(plain), lambda: runner.run(control), **timed)
    comparison = compare(lambda: runner.run(plain), lambda: runner.run(fused), **timed)
    ratios = Timing(comparison.ratios)
    return {
        "model": name,
        "mode": mode,
        "kind": MODELS[name].kind,
        "eager ms": eager.median * 1e3,
        "inductor ms": comparison.baseline.median * 1e3,
        "mfusion ms": comparison.candidate.median * 1e3,
        "inductor speedup": eager.median / comparison.baseline.median,
        "mfusion / inductor": comparison.ratio_median,
        "ratio p25-p75": f"{ratios.p25:.3f}-{ratios.p75:.3f}",
        "A/A control": a_a.ratio_median,
        "ratios": list(comparison.ratios),
        "A/A ratios": list(a_a.ratios),
        "compile s (inductor)": compile_s["plain"],
        "compile s (mfusion)": compile_s["fused"],
        "rewrites": _rewrites(report),
        "refused": _refusals(report),
        "regions outlined": _regions(report),
        "whole graph": [g.whole_graph for g in report.graphs if g.whole_graph],
        "refusal reasons": _refusal_reasons(report),
        "error / bound (inductor, mfusion)": [errors["plain"] / bound, errors["fused"] / bound],
        "accuracy": "pass" if max(errors.values()) <= bound else "FAIL",
    }


def run_row_in_processes(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one (model, mode) in ``--processes`` fresh processes, one after the other, and
    pool their rounds.

    A compiled graph's speed carries a draw that lasts as long as its process (where its code
    and constants land in memory, what ran before it): ResNet-18's A/A ratio changed sign from
    one process to the next although both variants compiled identical graphs. Rounds repeated
    inside one process share that draw, so only repeating the row in new processes averages it.
    Every row runs in a process of its own, with a fresh Inductor cache (each process compiles,
    rather than loading what an earlier one wrote), so no row inherits another's state.
    """
    rows = []
    for index in range(args.processes):
        if args.processes > 1:
            print(f"    process {index + 1}/{args.processes}", flush=True)
        rows.append(_run_row_in_child(name, mode))
    return combine_process_rows(rows)


class RowFailed(RuntimeError):
    """A row's process exited without reporting its row."""


def _run_row_in_child(name: str, mode: str) -> dict[str, Any]:
    """This script again with the same arguments, restricted to one row; its output is shown as
    it comes and its ``ROW`` line is the result."""
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    command += ["--models", name, "--modes", mode, "--row-only"]  # the last occurrence wins
    row = None
    with tempfile.TemporaryDirectory(prefix="mfusion-bench-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        with subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as child:
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith(ROW_PREFIX):
                    row = json.loads(line[len(ROW_PREFIX) :])
                else:
                    print(f"    | {line}", end="", flush=True)
    if child.returncode != 0 or row is None:
        raise RowFailed(f"{name} {mode}: its process exited with status {child.returncode}")
    return row


def combine_process_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same (model, mode) measured in several processes.

    The ratio columns are the median and quartiles of every process's per-round ratios pooled
    (each process contributes the same number of rounds); times are medians over the processes;
    the error is the largest; pass names, regions and notes that differ between processes are
    all listed. ``per process`` keeps each process's own median, the spread the pooling hides.
    """
    ratios = Timing([r for row in rows for r in row["ratios"]])
    a_a = Timing([r for row in rows for r in row["A/A ratios"]])
    errors = [max(row["error / bound (inductor, mfusion)"][i] for row in rows) for i in (0, 1)]

    def median_of(key: str) -> float:
        return statistics.median(float(row[key]) for row in rows)

    def distinct(key: str) -> str:
        return " | ".join(dict.fromkeys(str(row[key]) for row in rows))

    reasons: dict[str, list[str]] = {}
    for row in rows:
        for pass_name, texts in row["refusal reasons"].items():
            known = reasons.setdefault(pass_name, [])
            known.extend(t for t in texts if t not in known)
    combined = dict(rows[0])
    combined.update(
        {
            **{key: median_of(key) for key in TIME_COLUMNS},
            "mfusion / inductor": ratios.median,
            "ratio p25-p75": f"{ratios.p25:.3f}-{ratios.p75:.3f}",
            "A/A control": a_a.median,
            "per process": ", ".join(f"{row['mfusion / inductor']:.3f}" for row in rows),
            "A/A per process": ", ".join(f"{row['A/A control']:.3f}" for row in rows),
            "ratios": list(ratios.samples),
            "A/A ratios": list(a_a.samples),
            "rewrites": distinct("rewrites"),
            "refused": distinct("refused"),
            "regions outlined": distinct("regions outlined"),
            "whole graph": list(dict.fromkeys(n for row in rows for n in row["whole graph"])),
            "refusal reasons": reasons,
            "error / bound (inductor, mfusion)": errors,
            "max err (inductor, mfusion) / bound": f"{errors[0]:.2g}, {errors[1]:.2g}",
            "accuracy": "pass" if all(row["accuracy"] == "pass" for row in rows) else "FAIL",
        }
    )
    return combined


def _rewrites(report: mfusion.Report) -> str:
    """``gelu 2, rmsnorm 5``: rewrites per pass over every graph compiled (forward, backward)."""
    counts: dict[str, int] = {}
    for graph in report.graphs:
        for decision in graph.decisions:
            if decision.rewritten:
                counts[decision.pass_name] = counts.get(decision.pass_name, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _regions(report: mfusion.Report) -> str:
    """``1/4``: regions a kernel-generating backend (``mlir-cpu``) outlined and kept, of those
    planned; ``-`` when none was planned (the ``inductor`` backend plans but never outlines)."""
    planned = [r for g in report.graphs for r in g.regions if r.backend != "inductor"]
    return f"{sum(r.outlined for r in planned)}/{len(planned)}" if planned else "-"


def _refusals(report: mfusion.Report) -> str:
    """``attention 4``: matches per pass that were recognised but left alone (on a GPU, the
    CPU-measured rewrites refuse here with a reason; see ``refusal reasons``)."""
    counts: dict[str, int] = {}
    for graph in report.graphs:
        for decision in graph.decisions:
            if not decision.rewritten:
                counts[decision.pass_name] = counts.get(decision.pass_name, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _refusal_reasons(report: mfusion.Report) -> dict[str, list[str]]:
    """Per pass, the distinct reasons its matches were refused (for the JSON rows)."""
    reasons: dict[str, list[str]] = {}
    for graph in report.graphs:
        for decision in graph.decisions:
            if decision.rewritten:
                continue
            seen = reasons.setdefault(decision.pass_name, [])
            if decision.reason not in seen:
                seen.append(decision.reason)
    return reasons


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        import triton

        name = torch.cuda.get_device_name(device)
        return f"{name} (CUDA {torch.version.cuda}, Triton {triton.__version__})"
    return "cpu"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory for real_models.{json,md}")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--backend", default="inductor", help="mfusion backend (default inductor)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per row")
    parser.add_argument(
        "--copies",
        type=int,
        default=4,
        help="compiled copies per variant, taking turns sample by sample (default 4)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="fresh processes per row, one after the other, their rounds pooled (default 1); "
        "the only repetition that averages a compiled graph's per-process speed draw",
    )
    parser.add_argument("--row-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eager-repeats", type=int, default=5, help="eager samples per row")
    parser.add_argument("--sample-ms", type=float, default=25.0, help="duration of one sample")
    parser.add_argument("--tol", type=float, default=1e-3, help="fp32 accuracy gate (x scale)")
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda: where models and kernels run"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 with --device cpu; left alone on a GPU)",
    )
    parser.add_argument(
        "--max-wall-s",
        type=float,
        default=None,
        help="start no row once elapsed time plus the slowest row so far would pass this "
        "(the rest are listed as skipped); default: no limit",
    )
    parser.add_argument(
        "--no-freezing", dest="freezing", action="store_false", help="inference without freezing"
    )
    parser.add_argument(
        "--set",
        dest="options",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an MFusionConfig field for the mfusion variant, e.g. --set patch_conv=off "
        "or --set passes=gelu,rmsnorm",
    )
    args = parser.parse_args()
    if args.copies < 1:
        parser.error(f"--copies must be >= 1, got {args.copies}")
    if args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_wall_s is not None and not args.max_wall_s > 0:
        parser.error(f"--max-wall-s must be a positive number of seconds, got {args.max_wall_s}")
    args.device = _device(args.device)
    if args.threads is None and args.device.type == "cpu":
        args.threads = 1
    args.mfusion = {}
    for item in args.options:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected FIELD=VALUE")
        if key == "passes":
            args.mfusion[key] = tuple(v for v in value.split(",") if v)
        elif value.lower() in ("true", "false"):
            args.mfusion[key] = value.lower() == "true"
        else:
            args.mfusion[key] = value
    mfusion.MFusionConfig(**args.mfusion)  # refuse a bad --set before compiling anything
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    if args.row_only:  # a child of run_row_in_processes: measure one row, report it, stop
        row = run_model(args.models[0], args.modes[0], args)
        print(ROW_PREFIX + json.dumps(row, default=str), flush=True)
        return

    columns = [
        "model",
        "mode",
        "eager ms",
        "inductor ms",
        "mfusion ms",
        "inductor speedup",
        "mfusion / inductor",
        "ratio p25-p75",
        "A/A control",
        *(["per process", "A/A per process"] if args.processes > 1 else []),
        "compile s (inductor)",
        "compile s (mfusion)",
        "rewrites",
        "refused",
        "regions outlined",
        "max err (inductor, mfusion) / bound",
        "accuracy",
    ]
    rows = []
    skipped: list[str] = []
    failed: list[str] = []
    reasons: dict[str, list[str]] = {}
    start = time.perf_counter()
    slowest = 0.0
    jobs = [(m, mode) for m in args.models for mode in args.modes]
    for index, (name, mode) in enumerate(jobs, 1):
        elapsed = time.perf_counter() - start
        if args.max_wall_s is not None and elapsed + slowest > args.max_wall_s:
            skipped.append(f"{name} {mode}")
            print(f"[{index}/{len(jobs)}] {name} {mode}: skipped (--max-wall-s)", flush=True)
            continue
        print(f"[{index}/{len(jobs)}] {name} {mode} ...", flush=True)
        row_start = time.perf_counter()
        try:
            row = run_row_in_processes(name, mode, args)
        except RowFailed as error:
            failed.append(str(error))
            print(f"    FAILED: {error}", flush=True)
            continue
        slowest = max(slowest, time.perf_counter() - row_start)
        for note in row["whole graph"]:  # type: ignore[union-attr]
            print(f"    whole graph: {note}", flush=True)
        for pass_name, texts in row.pop("refusal reasons").items():  # type: ignore[union-attr]
            known = reasons.setdefault(pass_name, [])
            known.extend(t for t in texts if t not in known)
        rows.append(row)
        per_process = f", per process {row['per process']}" if args.processes > 1 else ""
        print(
            f"    mfusion/inductor {row['mfusion / inductor']:.3f}x{per_process} "
            f"(A/A {row['A/A control']:.3f}x, p25-p75 {row['ratio p25-p75']}), "
            f"rewrites {row['rewrites']}, refused {row['refused']}, "
            f"regions outlined {row['regions outlined']}, accuracy {row['accuracy']}",
            flush=True,
        )
        # One JSON line per row as it finishes, so a run stopped early keeps its rows.
        print(ROW_PREFIX + json.dumps(row, default=str), flush=True)
    summary = {}
    for label, keep in {
        "inference": lambda r: r["mode"].startswith("infer"),
        "training": lambda r: r["mode"].startswith("train"),
    }.items():
        chosen = [r["mfusion / inductor"] for r in rows if keep(r)]
        if chosen:
            summary[f"geomean mfusion/inductor ({label})"] = _geomean(chosen)
            summary[f"min mfusion/inductor ({label})"] = min(chosen)
    if not rows:
        raise SystemExit(f"no row ran: {'; '.join(failed) or '--max-wall-s too small?'}")
    profile = MachineProfile.detect()
    metadata = {
        "device": _describe_device(args.device),
        "torch": torch.__version__,
        "backend": args.backend,
        "mfusion options": {k: str(v) for k, v in args.mfusion.items()},
        "freezing (inference)": args.freezing,
        "mfusion machine profile": profile.describe(),
        "mfusion ISA level": profile.isa_level,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "compiled copies per variant": args.copies,
        "processes per row": args.processes,
        "threads": torch.get_num_threads(),
        "sample ms": args.sample_ms,
        "A/A control range": [
            min(r["A/A control"] for r in rows),
            max(r["A/A control"] for r in rows),
        ],
        **summary,
        "all accurate": all(r["accuracy"] == "pass" for r in rows),
        "refusal reasons (per pass)": reasons,
        "skipped (--max-wall-s)": skipped,
        "failed": failed,
        "wall s": time.perf_counter() - start,
    }
    kernels = "Triton" if args.device.type == "cuda" else "C++"
    table = BenchTable(
        "mfusion on transformers/diffusers models: Inductor vs Inductor + mfusion "
        f"({args.device.type}, {kernels} kernels)",
        columns,
        metadata,
    )
    for row in rows:
        table.add(**{c: row[c] for c in columns})
    table.write(args.out, "real_models")
    print(table.to_markdown())
    print(f"mfusion machine profile: {profile.describe()} (ISA level {profile.isa_level})")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}x")
    if skipped:
        print(f"skipped (--max-wall-s): {', '.join(skipped)}")
    print(f"wall time: {metadata['wall s']:.0f} s")
    if failed:
        raise SystemExit(f"rows that failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
