"""GELU written out (erf or tanh form) into its cheapest exact equivalent.

tanh form: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))`` equals
``x * sigmoid(2c x (1 + 0.044715 x^2))``
(since ``(1 + tanh z) / 2 = sigmoid(2z)``): six cheap ops instead of eight, no ``pow``.
erf form: ``0.5 x (1 + erf(x / sqrt 2))`` keeps erf but multiplies instead of dividing. An erf
form whose argument is already ``x * (1/sqrt 2)`` (what ``F.gelu``, ``nn.GELU`` and the GELU of
transformers' models decompose to in Inductor) is left alone: the rewrite would emit the same five
ops in another association, i.e. no saving, only a different rounding order (refused, with that
reason in the report).

Universal (no machine check): both forms stay one loop over the same data; the tanh form loses two
operations and ``pow`` and trades ``tanh`` for ``sigmoid`` (one exp and one reciprocal, which a
tanh needs too), the erf form trades a division for a multiply. Less work on any machine; the
size of the gain (0.25 -> 0.07 ms per call on the benchmark's CPU) is what varies.
"""

from __future__ import annotations

import math

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import (
    FLOAT_DTYPES,
    aten,
    close,
    dtype_of,
    emit,
    is_float_scalar,
    is_op,
    replace,
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_COEFF = 0.044715


def _factors(node: object, root: bool = True) -> list[object]:
    """Flatten a product tree of single-use multiplies into its factors (nodes and numbers)."""
    if is_op(node, aten.mul.Tensor) and (root or len(node.users) == 1):
        return _factors(node.args[0], False) + _factors(node.args[1], False)
    return [node]


def _scaled(node: object, x: fx.Node) -> float | None:
    """``k`` for ``mul(x, k)`` / ``div(x, 1/k)``; None when node is not a scaling of x."""
    if is_op(node, aten.mul.Tensor) and x in node.args[:2]:
        k = node.args[1] if node.args[0] is x else node.args[0]
        return float(k) if is_float_scalar(k) else None
    if is_op(node, aten.div.Tensor) and node.args[0] is x and is_float_scalar(node.args[1]):
        return 1.0 / float(node.args[1])
    return None


def _cube_coefficient(node: object, x: fx.Node) -> float | None:
    """``a`` for ``add(x, mul(x^3, a))``."""
    if not is_op(node, aten.add.Tensor) or x not in node.args[:2]:
        return None
    term = node.args[1] if node.args[0] is x else node.args[0]
    factors = _factors(term)
    numbers = [f for f in factors if is_float_scalar(f)]
    cubes = [f for f in factors if is_op(f, aten.pow.Tensor_Scalar) and f.args[0] is x]
    if len(numbers) != 1 or len(cubes) != 1 or len(factors) != 2:
        return None
    if cubes[0].args[1] != 3:
        raise Refusal(f"inner power {cubes[0].args[1]} is not 3: not the tanh GELU")
    return float(numbers[0])


class GELUPass(MFusionPass):
    """Match ``x * 0.5 * (1 + erf|tanh(...))`` over any association of the multiplies."""

    name = "gelu"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.mul.Tensor):
            return None
        factors = _factors(node)
        gates = [f for f in factors if is_op(f, aten.add.Tensor) and 1 in f.args[:2]]
        gates = [g for g in gates if is_op(g.args[0], aten.erf.default, aten.tanh.default)]
        if len(gates) != 1:
            return None
        gate = gates[0]
        inner = gate.args[0]
        if not isinstance(inner, fx.Node):  # the filter above made it an erf or tanh call
            return None
        rest = [f for f in factors if f is not gate]
        numbers = [f for f in rest if is_float_scalar(f)]
        tensors = [f for f in rest if isinstance(f, fx.Node)]
        # 0.5 may sit on x itself: mul(mul(x, 0.5), gate) flattens to x, 0.5, gate.
        if len(tensors) != 1 or len(numbers) > 1:
            return None
        x, half = tensors[0], (float(numbers[0]) if numbers else 1.0)
        arg = inner.args[0]
        if is_op(inner, aten.erf.default):
            scale = _scaled(arg, x)
            if scale is None:
                return None
            if not close(scale, 1 / math.sqrt(2)):
                raise Refusal(f"erf argument scaled by {scale:.6g}, GELU needs 1/sqrt(2)")
            if is_op(arg, aten.mul.Tensor):
                raise Refusal(
                    "erf GELU already multiplies by 1/sqrt(2) (aten.gelu's decomposition): "
                    "the rewrite would emit the same ops, nothing to save"
                )
            form = "erf"
        else:
            outer = (
                next((a for a in arg.args[:2] if isinstance(a, fx.Node)), None)
                if is_op(arg, aten.mul.Tensor)
                else None
            )
            scale = _scaled(arg, outer) if outer is not None else None
            coeff = _cube_coefficient(outer, x) if outer is not None else None
            if scale is None or coeff is None:
                return None
            if not close(scale, SQRT_2_OVER_PI) or not close(coeff, TANH_COEFF):
                raise Refusal(
                    f"tanh constants ({scale:.6g}, {coeff:.6g}) are not GELU's "
                    f"({SQRT_2_OVER_PI:.6g}, {TANH_COEFF})"
                )
            form = "tanh"
        if not close(half, 0.5):
            raise Refusal(f"outer scale {half:g}, GELU needs 0.5")
        if dtype_of(x) not in FLOAT_DTYPES:
            raise Refusal(f"dtype {dtype_of(x)} is not a floating dtype")

        def rewrite() -> str:
            graph = node.graph
            mul = aten.mul.Tensor
            if form == "tanh":
                k = 2 * SQRT_2_OVER_PI
                poly = emit(
                    graph,
                    aten.add.Tensor,
                    emit(graph, mul, emit(graph, mul, x, x), k * TANH_COEFF),
                    k,
                )
                out = emit(
                    graph, mul, x, emit(graph, aten.sigmoid.default, emit(graph, mul, x, poly))
                )
            else:
                erf = emit(graph, aten.erf.default, emit(graph, mul, x, 1 / math.sqrt(2)))
                out = emit(
                    graph, mul, x, emit(graph, aten.add.Tensor, emit(graph, mul, erf, 0.5), 0.5)
                )
            replace(node, out)
            return f"GELU ({form} form, {dtype_of(x)})"

        return rewrite
