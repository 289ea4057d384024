"""erf and tanh as rational functions: float32 accuracy without a transcendental call.

Inductor's CPU kernels call ATen's vectorised ``erf`` (a division, a polynomial and a full
Sleef ``exp``) and ``tanh`` (Sleef's ``tanhf_u10``), the costliest element-wise ops in the
transformer graphs mfusion sees: in BERT's inference the erf-GELU loop was 5.5% of the forward,
DiT's tanh-GELU 6.7%. Both functions are odd and saturate, so on a clamped range they are
``u * P(u^2) / Q(u^2)``: a clamp, one square, two short Horner chains, a multiply, a division and
a clamp of the result to [-1, 1], all ops Inductor fuses into the loop they sit in, with no
transcendental call. Over one 256x1024 float32 tensor on one AVX2 core that took erf-GELU from
1.00 to 0.76 ms and tanh-GELU from 2.08 to 0.78 ms (``benchmarks/rational_activations.py``).

Accuracy (float32 evaluation against float64, over [-12, 12]): erf 3.8e-7 max abs error
(Inductor's own vectorised erf: 5.3e-7; ATen's eager erf 5.6e-8), tanh 3.3e-7 (Inductor's and
ATen's tanh: 6e-8), i.e. within a few float32 ulps of 1. Inputs past the clamp give exactly +-1,
as the library functions do, NaN stays NaN, and the result never leaves [-1, 1]. The
coefficients come from ``benchmarks/rational_fit.py`` (a Lawson-reweighted least-squares
rational fit in float64); the tests check the accuracy bound, the saturation and the special
values on the compiled kernel.

Universal on CPUs (no machine check): the rational form is about 17 vector operations and no
``exp``, where ATen's erf is a polynomial, a division and a Sleef exp, and its tanh a Sleef
routine several times that; the ratio of the work does not depend on the vector width.
Refused: other dtypes (the fit is float32's; bf16 and fp16 graphs compute GELU and tanh in
float32 already, and float64 needs more terms), other devices (a GPU's erf and tanh are single
fast library calls, and element-wise loops there are bound by memory), and other kernel backends
(``mlir-cpu`` lowers erf and tanh inside its own regions).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from mfusion.backends.registry import BackendName
from mfusion.config import MFusionConfig
from mfusion.passes._graph import aten, emit, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


@dataclasses.dataclass(frozen=True)
class Rational:
    """``f(u) = clamp(u * P(u^2) / Q(u^2), -1, 1)`` for ``|u| <= clamp``, saturated past it."""

    function: str
    """What it approximates (``erf``, ``tanh``), for the report."""
    clamp: float
    numerator: tuple[float, ...]
    """P's coefficients from the constant term up."""
    denominator: tuple[float, ...]
    """Q's coefficients from the constant term up (Q(0) = 1, positive on the range)."""

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same computation in eager torch, in ``x``'s dtype (the tests' second opinion)."""
        u = x.clamp(-self.clamp, self.clamp)
        z = u * u
        return (u * _horner(z, self.numerator) / _horner(z, self.denominator)).clamp(-1.0, 1.0)


def _horner(z: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    acc = z * coefficients[-1] + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        acc = acc * z + c
    return acc


RATIONALS: dict[object, Rational] = {
    aten.erf.default: Rational(
        function="erf",
        clamp=4.0,
        numerator=(
            1.1283790502380038,
            0.20774078960283587,
            0.051611671498149915,
            0.0040166409265882455,
            0.00014786303240137786,
            -1.943542165817356e-06,
            1.908059901279556e-08,
        ),
        denominator=(
            1.0,
            0.517436816200117,
            0.11822942503882605,
            0.015012736556973856,
            0.001027223356538593,
        ),
    ),
    aten.tanh.default: Rational(
        function="tanh",
        clamp=9.0,
        numerator=(
            0.999999989540135,
            0.1338104379989567,
            0.003495607284753218,
            2.0609310001041976e-05,
            1.3354823142606918e-08,
        ),
        denominator=(
            1.0,
            0.46714359342446704,
            0.025877060846583536,
            0.00032856622580544625,
            7.776656399263444e-07,
        ),
    ),
}
"""The approximations by the op they replace (coefficients from ``benchmarks/rational_fit.py``)."""


def _emit_horner(graph: fx.Graph, z: fx.Node, coefficients: tuple[float, ...]) -> fx.Node:
    acc = emit(
        graph, aten.add.Tensor, emit(graph, aten.mul.Tensor, z, coefficients[-1]), coefficients[-2]
    )
    for c in reversed(coefficients[:-2]):
        acc = emit(graph, aten.add.Tensor, emit(graph, aten.mul.Tensor, acc, z), c)
    return acc


def _emit_clamp(graph: fx.Graph, x: object, bound: float) -> fx.Node:
    """``clamp(x, -bound, bound)`` in the two ops Inductor lowers (NaN passes through both)."""
    low = emit(graph, aten.clamp_min.default, x, -bound)
    return emit(graph, aten.clamp_max.default, low, bound)


class RationalPass(MFusionPass):
    """Anchor on ``erf``/``tanh`` of a float32 CPU tensor; emit its rational form in its place."""

    name = "rational"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, *RATIONALS):
            return None
        value = tensor_val(node.args[0])
        if value is None:
            return None
        if value.dtype != torch.float32:
            raise Refusal(f"dtype {value.dtype}: the rational fit is float32's")
        if value.device.type != "cpu":
            raise Refusal(
                f"device {value.device.type}: erf and tanh are single library calls there "
                "(measured on CPU only)"
            )
        backend = config.resolved_backend()
        if backend is not BackendName.INDUCTOR:
            raise Refusal(f"backend {backend.value} lowers erf and tanh in its own regions")
        rational = RATIONALS[node.target]

        def rewrite() -> str:
            graph = node.graph
            u = _emit_clamp(graph, node.args[0], rational.clamp)
            z = emit(graph, aten.mul.Tensor, u, u)
            ratio = emit(
                graph,
                aten.div.Tensor,
                emit(graph, aten.mul.Tensor, u, _emit_horner(graph, z, rational.numerator)),
                _emit_horner(graph, z, rational.denominator),
            )
            replace(node, _emit_clamp(graph, ratio, 1.0))
            degrees = f"{len(rational.numerator) - 1}/{len(rational.denominator) - 1}"
            return f"{rational.function} as a rational function ({degrees})"

        return rewrite
