"""Per-region benchmark of the mlir-cpu backend: MLIR scalar pipeline (0.3.1) vs MLIR vector
pipeline (0.3.2) vs Inductor's kernel for the same region, at one and two threads.

Each region class is a function traced to an aten graph (what auto-fusion outlines) at a
realistic size (hidden 768 / MLP 3072 over 2 x 128 tokens; attention scores 2 x 12 x 128 x
128). The Inductor side is the region compiled standalone by Inductor (the same stand-in the
measured choice uses, ``mfusion.mlir.standalone.inductor_kernel``); the MLIR sides are called the
way ``mfusion::mlir_region`` runs them (output allocation included, row blocks on threads for
the vector pipeline when the threads setting is above one). Samples of ~``--sample-ms`` each,
``--rounds`` interleaved rounds with the order rotating; reported: median of the per-round
ratios (MLIR time / Inductor time: below 1 means MLIR is faster) with p25-p75.

    python packages/mfusion/benchmarks/mlir_regions.py --threads 1 2 --out bench-results/mlir
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.backends.mlir_cpu import MLIRCPUBackend, format_out_spec
from mfusion.machine import MachineProfile
from mfusion.mlir.importer import import_region
from mfusion.mlir.runtime import compiled_region
from mfusion.mlir.standalone import example_inputs, inductor_kernel
from npu_core.bench import Timing, calls_per_sample, measure

TOKENS, HIDDEN, MLP, HEADS, SEQ = 256, 768, 3072, 12, 128


def gelu_tanh(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))


def gelu_erf(x, b):
    y = x + b
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def silu_mul(g, u):
    return g * torch.sigmoid(g) * u


def rmsnorm(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def add_layernorm(x, r, w, b):
    h = x + r
    d = h - h.mean(-1, keepdim=True)
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b, h


def linear_gelu(x, w, b):
    y = torch.addmm(b, x, w.permute(1, 0))
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def _linear_args(k: int, n: int) -> tuple[torch.Tensor, ...]:
    """Activations ``[TOKENS, k]``, a ``[n, k]`` weight scaled to keep outputs O(1), a bias."""
    return torch.randn(TOKENS, k), torch.randn(n, k) / k**0.5, torch.randn(n)


def softmax_scaled(s, mask):
    s = s * 0.125 + mask
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


REGIONS: dict[str, tuple[str, Callable[..., object], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "gelu_tanh": (
        "elementwise",
        gelu_tanh,
        lambda: (torch.randn(TOKENS, MLP), torch.randn(MLP)),
    ),
    "gelu_erf": ("elementwise", gelu_erf, lambda: (torch.randn(TOKENS, MLP), torch.randn(MLP))),
    "silu_mul": (
        "elementwise",
        silu_mul,
        lambda: (torch.randn(TOKENS, MLP), torch.randn(TOKENS, MLP)),
    ),
    "rmsnorm": ("norm", rmsnorm, lambda: (torch.randn(TOKENS, HIDDEN), torch.randn(HIDDEN))),
    "add_layernorm": (
        "norm",
        add_layernorm,
        lambda: (
            torch.randn(TOKENS, HIDDEN),
            torch.randn(TOKENS, HIDDEN),
            torch.randn(HIDDEN),
            torch.randn(HIDDEN),
        ),
    ),
    "linear_gelu_up": ("matmul", linear_gelu, lambda: _linear_args(HIDDEN, MLP)),
    "linear_gelu_down": ("matmul", linear_gelu, lambda: _linear_args(MLP, HIDDEN)),
    "softmax": (
        "softmax",
        softmax_scaled,
        lambda: (torch.randn(2, HEADS, SEQ, SEQ), torch.randn(2, 1, 1, SEQ)),
    ),
}


def per_call(fn: Callable[[], object], budget_s: float) -> float:
    """Seconds per call of ``fn`` over one sample of about ``budget_s`` (one warm-up call)."""
    calls = calls_per_sample(fn, budget_s * 1e3, warmup=1, repeats=1)
    return measure(fn, calls=calls, warmup=0, repeats=1).median


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, p25 and p75 of the per-round ratios."""
    timing = Timing(tuple(values))
    return timing.median, timing.p25, timing.p75


def mlir_call(gm, inputs, pipeline: str, threads: int) -> Callable[[], object]:
    ir = import_region(gm)
    compiled = compiled_region(ir, pipeline)  # type: ignore[arg-type]
    outputs = [
        v for v in (n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].all_input_nodes)
    ]
    spec = format_out_spec(outputs)
    block_ir, split = ("", "")
    if pipeline == "vector":
        block_ir, split = MLIRCPUBackend._blocks(_Region(gm), threads, compiled)
    op = torch.ops.mfusion.mlir_region.default  # as the compiled graph calls it
    return lambda: op(inputs, ir, spec, pipeline, block_ir, split)


class _Region:
    """What ``MLIRCPUBackend._blocks`` reads of an outlined region."""

    def __init__(self, gm) -> None:
        self.module = gm


def bench(
    name: str, threads: int, rounds: int, sample_s: float, scalar: bool = True
) -> dict[str, object]:
    kind, fn, make = REGIONS[name]
    torch.manual_seed(0)
    args = make()
    gm = make_fx(fn, tracing_mode="fake")(*args)
    inputs = example_inputs(gm)
    calls = {"inductor": inductor_kernel(gm, inputs)}
    if scalar:
        calls["scalar"] = mlir_call(gm, inputs, "scalar", threads)
    calls["vector"] = mlir_call(gm, inputs, "vector", threads)
    mlir = [k for k in ("scalar", "vector") if k in calls]
    expected = fn(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    # a GEMM sums K products in another order than eager's BLAS: fp32 rounding grows with K
    tol = 1e-3 if kind == "matmul" else 1e-4
    for variant in mlir:
        got = calls[variant]()
        for g, e in zip(got, expected, strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(g, e, atol=tol, rtol=tol, msg=f"{name} {variant}")
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            times[k].append(per_call(calls[k], sample_s))
    row: dict[str, object] = {"region": name, "class": kind, "threads": threads}
    for k in calls:
        row[f"{k}_us"] = statistics.median(times[k]) * 1e6
    for k in mlir:
        ratios = [m / i for m, i in zip(times[k], times["inductor"], strict=True)]
        row[f"{k}_ratio"], row[f"{k}_p25"], row[f"{k}_p75"] = quartiles(ratios)
    return row


def _number(row: dict[str, object], key: str, digits: int) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", nargs="*", default=list(REGIONS), choices=list(REGIONS))
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--no-scalar",
        action="store_true",
        help="skip the scalar pipeline (seconds per call on the GEMM rows)",
    )
    args = parser.parse_args(argv)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.regions:
            rows.append(bench(name, threads, args.rounds, args.sample_ms / 1e3, not args.no_scalar))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    header = (
        "| region | class | threads | inductor us | scalar us | vector us "
        "| scalar / inductor | vector / inductor (p25-p75) |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"| {r['region']} | {r['class']} | {r['threads']} | {r['inductor_us']:.0f} "
            f"| {_number(r, 'scalar_us', 0)} | {r['vector_us']:.0f} "
            f"| {_number(r, 'scalar_ratio', 2)} "
            f"| {r['vector_ratio']:.2f} ({r['vector_p25']:.2f}-{r['vector_p75']:.2f}) |"
        )
    machine = MachineProfile.detect()
    table = "\n".join(lines)
    print(f"machine: {machine.describe()}; torch {torch.__version__}; {platform.python_version()}")
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mlir_regions.json").write_text(json.dumps(rows, indent=1))
        (args.out / "mlir_regions.md").write_text(f"machine: {machine.describe()}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
