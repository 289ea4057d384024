"""FX helpers for the passes: op tests, constants, fake-tensor metadata, lowerable emission."""

from __future__ import annotations

import collections
import contextlib
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, TypeGuard

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default

# Ops whose result is a view (or reshape) of their input: free for fusion, never worth a region.
VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.t.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.expand.default,
        aten.slice.Tensor,
    }
)


def is_op(node: object, *targets: object) -> TypeGuard[fx.Node]:
    """True if ``node`` is a call of one of ``targets`` (op overloads)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def as_node(value: object) -> fx.Node | None:
    """``value`` when it is a graph node (an op argument may also be a number, dtype, list...)."""
    return value if isinstance(value, fx.Node) else None


def val(node: object) -> Any:
    """The fake tensor (or SymInt) recorded for ``node``; None when unknown."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def tensor_val(node: object) -> torch.Tensor | None:
    value = val(node)
    return value if isinstance(value, torch.Tensor) else None


def dtype_of(node: object) -> torch.dtype | None:
    value = tensor_val(node)
    return value.dtype if value is not None else None


def ndim_of(node: object) -> int | None:
    value = tensor_val(node)
    return value.dim() if value is not None else None


def is_float_scalar(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def close(value: object, expected: float, rel: float = 1e-4) -> bool:
    """True if ``value`` is a Python number within ``rel`` of ``expected``."""
    return is_float_scalar(value) and math.isclose(float(value), expected, rel_tol=rel)


def int_list(value: object) -> list[int] | None:
    """``value`` as written (negative dims kept) when it is an int or a sequence of ints."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(d, int) for d in value):
        return [int(d) for d in value]
    return None


def normalized_dims(dims: object, ndim: int) -> tuple[int, ...] | None:
    """Reduction dims as sorted non-negative ints, or None if not a plain int list."""
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, Sequence) or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted(d % ndim for d in dims))


def is_last_dim_reduction(dims: object, ndim: int | None) -> bool:
    return ndim is not None and ndim > 0 and normalized_dims(dims, ndim) == (ndim - 1,)


def square_base(node: object) -> fx.Node | None:
    """``x`` for ``pow(x, 2)`` or ``mul(x, x)``; None otherwise."""
    if is_op(node, aten.pow.Tensor_Scalar) and node.args[1] == 2:
        return as_node(node.args[0])
    if is_op(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return as_node(node.args[0])
    return None


def other_operand(node: fx.Node, known: object) -> object | None:
    """The operand of a commutative binary op that is not ``known``; None if absent."""
    a, b = node.args[0], node.args[1]
    if a is known:
        return b
    if b is known:
        return a
    return None


def fake_mode_of(graph: fx.Graph) -> FakeTensorMode | None:
    for node in graph.nodes:
        value = val(node)
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def _fake_args(args: Any) -> Any:
    """``args`` (any nesting of an op's arguments) with each node replaced by its fake value."""
    return fx.node.map_arg(args, lambda n: n.meta["val"])


def is_lowerable(target: object) -> bool:
    """True if Inductor has its own lowering for ``target`` (so it never becomes an eager call)."""
    from torch._inductor.lowering import lowerings

    return target in lowerings


def emit(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point with its fake value.

    Raises:
        ValueError: ``target`` has no Inductor lowering. The passes only emit lowerable ops so
            a rewritten region is still fused by Inductor, never run as an opaque eager kernel.
    """
    if target is not operator.getitem and not is_lowerable(target):
        raise ValueError(f"{target} has no Inductor lowering; a pass must not emit it")
    node = graph.call_function(target, args, kwargs)
    fake_mode = fake_mode_of(graph)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*_fake_args(args), **_fake_args(kwargs))
    return node


def replace(old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` (dead code is removed by the cleanup pass)."""
    old.replace_all_uses_with(new)


def live_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    """Snapshot of call nodes, skipping those erased while iterating."""
    for node in list(graph.nodes):
        if node.graph is graph and node.op == "call_function":
            yield node


def op_counts(graph: fx.Graph) -> collections.Counter[str]:
    """How many times each op overload is called in ``graph`` (a report's before and after)."""
    return collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


def cast_target(node: object) -> torch.dtype | None:
    """The dtype a pure dtype cast converts to (post-grad ``convert_element_type`` or traced
    ``_to_copy(dtype=...)``); None when ``node`` is not such a cast."""
    if is_op(node, CONVERT):
        return _as_dtype(node.args[1])
    if is_op(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype", "layout", "device"}:
        source = tensor_val(node.args[0])
        out = tensor_val(node)
        if source is not None and out is not None and source.device == out.device:
            return _as_dtype(node.kwargs.get("dtype"))
    return None


def _as_dtype(value: object) -> torch.dtype | None:
    return value if isinstance(value, torch.dtype) else None


CONSTANT_NODES = 64
"""Largest subgraph :func:`constant_value` evaluates (masks built from ``iota``: ~15 nodes)."""
CONSTANT_NUMEL = 1 << 24
"""Largest tensor :func:`constant_value` materialises on the way (a 4096 x 4096 mask)."""


def constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` when it depends on no graph input: its ancestors are factory ops
    (``iota``, ``full``, ...), frozen constants (``get_attr``) and deterministic ops on them.
    Evaluated now with real tensors; None when it reads an input, is too large, or an op is
    random or fails. Used to prove a property of a value (a causal mask) at compile time."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > CONSTANT_NODES or current.op not in ("call_function", "get_attr"):
            return None
        if current.op == "call_function":
            target = current.target
            if not isinstance(target, torch._ops.OpOverload):
                return None
            if torch.Tag.nondeterministic_seeded in target.tags:
                return None
        value = tensor_val(current)
        if value is not None and value.numel() > CONSTANT_NUMEL:
            return None
        stack.extend(current.all_input_nodes)
    root = node.graph.owning_module
    env: dict[fx.Node, Any] = {}
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            for current in node.graph.nodes:
                if current not in seen:
                    continue
                if current.op == "get_attr":
                    if root is None:
                        return None
                    attribute: Any = root
                    for part in str(current.target).split("."):
                        attribute = getattr(attribute, part)
                    env[current] = attribute
                else:
                    args = fx.map_arg(current.args, env.__getitem__)
                    kwargs = fx.map_arg(current.kwargs, env.__getitem__)
                    env[current] = current.target(*args, **kwargs)
    except Exception:  # an op that cannot run eagerly here: not provably constant
        return None
    result = env[node]
    return result if isinstance(result, torch.Tensor) else None
