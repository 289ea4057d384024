"""Dynamic-shape regions of the mlir-cpu backend: the one kernel compiled with symbolic rows
against the static kernel of the same region at the same size, and against Inductor's kernel
for the region compiled with symbolic rows (what a ``dynamic=True`` graph runs otherwise).

Row regions (norms) and GEMM regions (a linear with its epilogue: BERT-base's FFN up-projection
768 -> 3072 with GELU and down-projection 3072 -> 768 with the residual add, M = rows symbolic,
K and N static). Each region is traced twice: rows symbolic (hidden size and weights static, as
Dynamo's ``dynamic=True`` leaves a model's hidden size once it is a parameter's size) and fully
static. Each side is
called the way the compiled graph calls it: the MLIR kernels through ``mfusion::mlir_region``
(output allocation from the call's inputs included), Inductor's kernel as
``mfusion.mlir.standalone.graph_kernel`` compiles it from the symbolic graph (the stand-in the
measured choice uses for dynamic regions). Samples of about ``--sample-ms``, ``--rounds``
interleaved rounds with the order rotating; reported: median of the per-round ratios with
p25-p75 (below 1: the first side is faster).

    python packages/mfusion/benchmarks/mlir_dynamic.py --rounds 11
    python packages/mfusion/benchmarks/mlir_dynamic.py --regions linear_gelu_768x3072 \
        linear_residual_3072x768 --rows 256 257 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.backends.mlir_cpu import format_out_spec
from mfusion.machine import MachineProfile
from mfusion.mlir.importer import import_region
from mfusion.mlir.runtime import compiled_region
from mfusion.mlir.standalone import graph_kernel
from npu_core.bench import Timing, calls_per_sample, measure

Call = Callable[[], object]


def rmsnorm(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def layernorm_gelu(x, w, b):
    d = x - x.mean(-1, keepdim=True)
    y = d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def linear_gelu(x, w, b):
    y = torch.addmm(b, x, w.permute(1, 0))
    return 0.5 * y * (1 + torch.erf(y * 0.7071067811865476))


def linear_residual(x, w, b, r):
    return torch.addmm(b, x, w.permute(1, 0)) + r


Inputs = tuple[list[torch.Tensor], set[int]]


def _norm_inputs(weights: int) -> Callable[[int, int], Inputs]:
    def make(rows: int, hidden: int) -> Inputs:
        vectors = [1 + 0.1 * torch.randn(hidden) for _ in range(weights)]
        return [torch.randn(rows, hidden), *vectors], {0}

    return make


def _linear_inputs(k: int, n: int, residual: bool) -> Callable[[int, int], Inputs]:
    """x (rows x k), weight (n x k), bias, and a rows x n residual; ``hidden`` is not used."""

    def make(rows: int, hidden: int) -> Inputs:
        x, w, b = torch.randn(rows, k), torch.randn(n, k) / k**0.5, torch.randn(n)
        if residual:
            return [x, w, b, torch.randn(rows, n)], {0, 3}
        return [x, w, b], {0}

    return make


REGIONS = {
    "rmsnorm": (rmsnorm, _norm_inputs(1)),
    "layernorm_gelu": (layernorm_gelu, _norm_inputs(2)),
    "linear_gelu_768x3072": (linear_gelu, _linear_inputs(768, 3072, residual=False)),
    "linear_residual_3072x768": (linear_residual, _linear_inputs(3072, 768, residual=True)),
}
"""name -> (function, inputs for (rows, hidden) with the indices of the inputs whose dim 0 is
the symbolic row count)."""
GEMMS = ("linear_gelu_768x3072", "linear_residual_3072x768")
"""The GEMM regions: their K and N are fixed, ``--hidden`` applies to the row regions only."""


def trace(fn, args: list[torch.Tensor], symbolic_rows: set[int]) -> fx.GraphModule:
    """``fn``'s aten graph, dim 0 of the arguments in ``symbolic_rows`` symbolic (hint: its
    size); static if the set is empty."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    if not symbolic_rows:
        return make_fx(fn, tracing_mode="fake")(*args)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = []
    for index, arg in enumerate(args):
        sizes = [
            DimDynamic.DYNAMIC if index in symbolic_rows and d == 0 else DimDynamic.STATIC
            for d in range(arg.dim())
        ]
        fakes.append(mode.from_tensor(arg, symbolic_context=StatelessSymbolicContext(sizes)))
    with mode:
        return make_fx(fn, tracing_mode="fake")(*fakes)


def mlir_call(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> tuple[Call, bool]:
    """The region as the compiled graph calls it, and whether its kernel has dynamic dims."""
    ir = import_region(gm)
    kernel = compiled_region(ir, "vector")
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    outputs = [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].all_input_nodes]
    spec = format_out_spec(outputs, placeholders)
    op = torch.ops.mfusion.mlir_region.default
    return (lambda: op(inputs, ir, spec, "vector", "", "")), kernel.dynamic


def per_call(fn: Call, budget_s: float) -> float:
    """Seconds per call of ``fn`` over one sample of about ``budget_s`` (one warm-up call)."""
    calls = calls_per_sample(fn, budget_s * 1e3, warmup=1, repeats=1)
    return measure(fn, calls=calls, warmup=0, repeats=1).median


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, p25 and p75 of the per-round ratios."""
    timing = Timing(tuple(values))
    return timing.median, timing.p25, timing.p75


def bench(name: str, rows: int, hidden: int, rounds: int, sample_s: float) -> dict[str, object]:
    fn, make_inputs = REGIONS[name]
    torch.manual_seed(0)
    inputs, row_inputs = make_inputs(rows, hidden)
    dynamic_gm = trace(fn, inputs, symbolic_rows=row_inputs)
    static_gm = trace(fn, inputs, symbolic_rows=set())
    dynamic_mlir, is_dynamic = mlir_call(dynamic_gm, inputs)
    static_mlir, _ = mlir_call(static_gm, inputs)
    assert is_dynamic, "the symbolic trace must give a kernel with dynamic dims"
    inductor = graph_kernel(dynamic_gm, inputs)
    calls = {"mlir_dynamic": dynamic_mlir, "mlir_static": static_mlir, "inductor_dynamic": inductor}
    expected = fn(*inputs)
    for side, call in calls.items():
        got = call()
        got = got[0] if isinstance(got, (list, tuple)) else got
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{name} {side}")
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            times[k].append(per_call(calls[k], sample_s))
    row: dict[str, object] = {
        "region": name,
        "rows": rows,
        "hidden": "-" if name in GEMMS else hidden,
    }
    for k in calls:
        row[f"{k}_us"] = statistics.median(times[k]) * 1e6
    for first, second in (("mlir_dynamic", "mlir_static"), ("mlir_dynamic", "inductor_dynamic")):
        ratios = [a / b for a, b in zip(times[first], times[second], strict=True)]
        row[f"{first}/{second}"] = quartiles(ratios)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", nargs="*", default=list(REGIONS), choices=list(REGIONS))
    parser.add_argument("--rows", nargs="*", type=int, default=[256, 1000])
    parser.add_argument("--hidden", nargs="*", type=int, default=[256, 768])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for name in args.regions:
        for hidden in args.hidden[:1] if name in GEMMS else args.hidden:
            for rows in args.rows:
                results.append(bench(name, rows, hidden, args.rounds, args.sample_ms / 1e3))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(
        f"machine: {MachineProfile.detect().describe()}; torch {torch.__version__}; "
        f"python {platform.python_version()}; {args.rounds} rounds, one thread"
    )
    print(
        "| region | rows x hidden | MLIR dynamic us | MLIR static us | Inductor dynamic us "
        "| dynamic / static (p25-p75) | dynamic / Inductor (p25-p75) |\n"
        "| --- | --- | ---: | ---: | ---: | --- | --- |"
    )
    for r in results:
        a = r["mlir_dynamic/mlir_static"]
        b = r["mlir_dynamic/inductor_dynamic"]
        print(
            f"| {r['region']} | {r['rows']} x {r['hidden']} | {r['mlir_dynamic_us']:.0f} "
            f"| {r['mlir_static_us']:.0f} | {r['inductor_dynamic_us']:.0f} "
            f"| {a[0]:.2f} ({a[1]:.2f}-{a[2]:.2f}) | {b[0]:.2f} ({b[1]:.2f}-{b[2]:.2f}) |"  # type: ignore[index]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
