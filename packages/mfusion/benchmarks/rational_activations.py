"""Inductor's erf/tanh kernels against the ``rational`` pass's form, per activation.

    python packages/mfusion/benchmarks/rational_activations.py --out bench-results/rational

Each activation is compiled twice over one float32 tensor of ``--rows`` x ``--cols`` (default
256 x 1024: BERT's MLP activation at 2 x 128 tokens): with Inductor alone and with mfusion
running only the ``rational`` pass. Both are timed in interleaved rounds (order alternating,
collector paused, one torch thread); reported: each median and the median of per-round ratios
(Inductor time / mfusion time: above 1 means the rational form is faster) with p25-p75, and each
form's max abs error against float64 torch over the same tensor.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mfusion
from npu_core.bench import BenchTable, Timing, calls_per_sample, compare

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "erf-GELU": F.gelu,
    "tanh-GELU": lambda x: F.gelu(x, approximate="tanh"),
    "erf": torch.erf,
    "tanh": torch.tanh,
}


def _row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, args) -> dict[str, object]:
    """Both compiled forms of ``fn`` over ``x``: times, their ratio and accuracy."""
    torch._dynamo.reset()
    plain = torch.compile(fn, options={"post_grad_custom_post_pass": None})
    rational = torch.compile(fn, options=mfusion.compile_options(passes=("rational",)))
    reference = fn(x.double())
    errors = [(f(x).double() - reference).abs().max().item() for f in (plain, rational)]
    calls = calls_per_sample(lambda: plain(x), args.sample_ms)
    result = compare(
        lambda: plain(x), lambda: rational(x), calls=calls, repeats=args.repeats, pause_gc=True
    )
    ratios = Timing(result.ratios)
    return {
        "inductor us": result.baseline.median * 1e6,
        "rational us": result.candidate.median * 1e6,
        "inductor / rational": result.ratio_median,
        "p25-p75": f"{ratios.p25:.3f}-{ratios.p75:.3f}",
        "max error (inductor)": f"{errors[0]:.1e}",
        "max error (rational)": f"{errors[1]:.1e}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for rational.{json,md}")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds")
    parser.add_argument("--sample-ms", type=float, default=20.0, help="duration of one sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 3
    table = BenchTable(
        f"erf/tanh: Inductor vs the rational pass ({args.rows} x {args.cols} float32, 1 thread)",
        [
            "activation",
            "inductor us",
            "rational us",
            "inductor / rational",
            "p25-p75",
            "max error (inductor)",
            "max error (rational)",
        ],
        metadata=vars(args),
    )
    for name, fn in ACTIVATIONS.items():
        table.add(activation=name, **_row(fn, x, args))
        print(table.rows[-1], flush=True)
    _, md = table.write(args.out, "rational")
    print(md.read_text())


if __name__ == "__main__":
    main()
