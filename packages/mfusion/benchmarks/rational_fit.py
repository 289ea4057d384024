"""Fit the rational approximations of erf and tanh that the ``rational`` pass emits.

    python packages/mfusion/benchmarks/rational_fit.py --out bench-results/mfusion

Both functions are odd and saturate: ``f(x) = x * P(x^2) / Q(x^2)`` on ``|x| <= clamp``, the
result clamped to [-1, 1], with P scaled so that the float32 evaluation reaches 1 at the clamp
(so every input past it gives exactly +-1, as the float32 library functions do: erf(4) and
tanh(9) are within 2e-8 of 1, and neither ever leaves [-1, 1]). The fit is a linearised
least-squares problem on Chebyshev-clustered points, reweighted (Lawson iterations) towards the
smallest maximum relative error, in float64.

The script writes each fit's float64 error and the float32 max abs error against float64 on a
dense grid past the clamp: of the same Horner evaluation (what the compiled kernel computes), of
torch's eager function and of Inductor's kernel for it. It prints the coefficients to paste into
``mfusion/passes/rational.py`` (also in the JSON's metadata).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from mfusion.passes.rational import Rational
from npu_core.bench import BenchTable

F64 = torch.float64


def fit(fn, clamp: float, num_degree: int, den_degree: int, iterations: int = 40):
    """``(Rational, max relative error)``: ``fn(x)/x ~ P(x^2)/Q(x^2)`` on ``[0, clamp]``, Q(0)=1."""
    n = 20_000
    t = torch.cos(torch.linspace(math.pi, 0.0, n, dtype=F64))
    z = (t + 1) / 2 * clamp**2
    x = z.sqrt()
    tiny = torch.tensor(1e-8, dtype=F64)
    slope = (fn(tiny) / tiny).item()  # the limit of fn(x)/x at 0
    target = torch.where(x > 0, fn(x) / x.clamp_min(1e-300), torch.full_like(x, slope))
    powers_p = torch.stack([z**k for k in range(num_degree + 1)], dim=1)
    powers_q = torch.stack([z**k for k in range(1, den_degree + 1)], dim=1)
    system = torch.cat([powers_p, -target[:, None] * powers_q], dim=1)
    lawson = torch.ones(n, dtype=F64)
    weight = torch.ones(n, dtype=F64)
    for _ in range(iterations):
        w = (weight * lawson / target.abs())[:, None]
        solution = torch.linalg.lstsq(system * w, target * w[:, 0]).solution
        p = solution[: num_degree + 1]
        q = torch.cat([torch.ones(1, dtype=F64), solution[num_degree + 1 :]])
        num, den = powers_p @ p, torch.cat([torch.ones(n, 1, dtype=F64), powers_q], 1) @ q
        error = (num / den - target) / target
        weight = 1 / den.abs()  # linearised residual -> residual of the ratio
        lawson = lawson * error.abs().sqrt() + 1e-300
        lawson = lawson / lawson.max()
    # Scale P so that f(clamp) is 1 in float64, then up by float32 half-ulps until the float32
    # evaluation reaches 1 there: the output clamp then makes every saturated input exactly +-1.
    zc = clamp**2
    p = p / (
        clamp * sum(c * zc**k for k, c in enumerate(p)) / sum(c * zc**k for k, c in enumerate(q))
    )
    edge = torch.tensor(clamp, dtype=torch.float32)
    for _ in range(16):
        rational = Rational(fn.__name__, clamp, tuple(p.tolist()), tuple(q.tolist()))
        if rational.reference(edge).item() == 1.0:
            break
        p = p * (1 + 2.0**-24)
    return rational, error.abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for rational_fit.{json,md}")
    args = parser.parse_args()
    # The least-squares systems are ill-conditioned: another thread count (another summation
    # order in LAPACK) gives other coefficients of the same accuracy. One thread reproduces the
    # pass's; the tests check the accuracy of whichever the pass carries.
    torch.set_num_threads(1)
    table = BenchTable(
        "Rational erf/tanh: fit and float32 accuracy (max abs error against float64, [-12, 12])",
        [
            "function",
            "degrees P/Q",
            "clamp",
            "fit rel error (float64)",
            "rational",
            "torch (eager)",
            "Inductor kernel",
        ],
    )
    grid = torch.linspace(-12.0, 12.0, 4_000_001, dtype=F64)
    for name, fn, clamp, degrees in (
        ("erf", torch.erf, 4.0, (6, 4)),
        ("tanh", torch.tanh, 9.0, (4, 4)),
    ):
        rational, rel = fit(fn, clamp, *degrees)
        reference = fn(grid)
        errors = [
            (f(grid.float()).double() - reference).abs().max().item()
            for f in (rational.reference, fn, torch.compile(fn))
        ]
        table.add(
            function=name,
            clamp=clamp,
            **{
                "degrees P/Q": f"{degrees[0]}/{degrees[1]}",
                "fit rel error (float64)": f"{rel:.1e}",
                "rational": f"{errors[0]:.1e}",
                "torch (eager)": f"{errors[1]:.1e}",
                "Inductor kernel": f"{errors[2]:.1e}",
            },
        )
        table.metadata[name] = dataclasses.asdict(rational)
        print(f"{name}: {rational!r}")
    _, md = table.write(args.out, "rational_fit")
    print(md.read_text())


if __name__ == "__main__":
    main()
