"""Rotary position embedding ``x * cos + rotate_half(x) * sin`` into the split-half form.

``rotate_half(x) = cat(-x2, x1)`` materialises a rotated copy before two full-width multiplies;
the split form ``cat(x1 c1 - x2 s1, x2 c2 + x1 s2)`` reads each half once and has no negation.
In bf16/fp16 the split form rounds at other points than eager's chain of bf16 ops, so it is
refused there unless ``rope_low_precision`` is set.

Universal (no machine check): no rotated copy and no negation, the same passes over memory: never
more work on any machine.
"""

from __future__ import annotations

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import LOW_PRECISION, aten, emit, is_op, replace, tensor_val
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def _half(node: object, x: fx.Node, start: int, end: int) -> bool:
    if not is_op(node, aten.slice.Tensor) or node.args[0] is not x:
        return False
    dim, lo, hi = ([*list(node.args[1:4]), None, None, None])[:3]
    value = tensor_val(x)
    if value is None or not isinstance(dim, int) or not isinstance(hi, int):
        return False
    ndim = value.dim()
    return dim % ndim == ndim - 1 and isinstance(lo, int) and lo == start and min(hi, end) == end


def _rotate_half_input(node: object) -> fx.Node | None:
    """``x`` for ``cat([-x[..., h:], x[..., :h]], -1)``."""
    if not is_op(node, aten.cat.default):
        return None
    tensors = node.args[0]
    if not isinstance(tensors, list | tuple) or len(tensors) != 2:
        return None
    neg, first = tensors
    if not is_op(neg, aten.neg.default) or not is_op(first, aten.slice.Tensor):
        return None
    x = first.args[0]
    value = tensor_val(x)
    if not isinstance(x, fx.Node) or value is None:
        return None
    if not isinstance(value.shape[-1], int) or value.shape[-1] % 2:
        return None
    h = value.shape[-1] // 2
    dim = node.args[1] if len(node.args) > 1 else 0
    if not isinstance(dim, int) or dim % value.dim() != value.dim() - 1:
        return None
    if _half(first, x, 0, h) and _half(neg.args[0], x, h, 2 * h):
        return x
    return None


def _mul_split(node: object) -> tuple[fx.Node, fx.Node] | None:
    if not is_op(node, aten.mul.Tensor):
        return None
    a, b = node.args[:2]
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


class RoPEPass(MFusionPass):
    """Anchor on ``add(mul(x, cos), mul(rotate_half(x), sin))`` in either operand order."""

    name = "rope"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.add.Tensor):
            return None
        first, second = (_mul_split(a) for a in node.args[:2])
        if first is None or second is None:
            return None
        terms = (first, second)
        found: tuple[fx.Node, fx.Node, fx.Node] | None = None
        for i in (0, 1):
            for rot, sin in (terms[i], terms[i][::-1]):
                x = _rotate_half_input(rot)
                if x is None:
                    continue
                for xx, cos in (terms[1 - i], terms[1 - i][::-1]):
                    if xx is x:
                        found = (x, cos, sin)
        if found is None:
            return None
        x, cos, sin = found
        vx, vc, vs = tensor_val(x), tensor_val(cos), tensor_val(sin)
        if vx is None or vc is None or vs is None:
            return None  # a value without recorded shape and dtype: nothing to check against
        if vx.dtype in LOW_PRECISION and not config.rope_low_precision:
            raise Refusal(f"{vx.dtype} RoPE: the fused form would drift from eager rounding")
        d = vx.shape[-1]
        for name, v in (("cos", vc), ("sin", vs)):
            if v.shape[-1] != d:
                raise Refusal(f"{name} last dim {v.shape[-1]} != head dim {d}: cannot split halves")
            if v.dtype != vx.dtype:
                raise Refusal(f"{name} dtype {v.dtype} differs from x's {vx.dtype}")
        h = d // 2

        def rewrite() -> str:
            graph = node.graph

            def half(t: fx.Node, first: bool) -> fx.Node:
                return emit(graph, aten.slice.Tensor, t, -1, 0 if first else h, h if first else d)

            x1, x2 = half(x, True), half(x, False)
            c1, c2, s1, s2 = half(cos, True), half(cos, False), half(sin, True), half(sin, False)
            mul, add, sub = aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor
            lo = emit(graph, sub, emit(graph, mul, x1, c1), emit(graph, mul, x2, s1))
            hi = emit(graph, add, emit(graph, mul, x2, c2), emit(graph, mul, x1, s2))
            replace(node, emit(graph, aten.cat.default, [lo, hi], -1))
            return f"RoPE over head dim {d} ({vx.dtype})"

        return rewrite
