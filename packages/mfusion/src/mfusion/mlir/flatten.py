"""Matmul regions rewritten in 2-D: the GEMM lowering handles a 2-D matmul with a 2-D epilogue.

A linear inside a transformer reads its activations as ``[batch, tokens, hidden]``: the graph
flattens them to 2-D for the ``addmm``, views the result back to 3-D, and the epilogue (bias,
GELU, a residual add) runs on the 3-D view. torch-mlir lowers those views to
``tensor.collapse_shape``/``expand_shape`` around the matmul, which the tiled GEMM strategy
(:mod:`mfusion.mlir.gemm`) does not take, so such a region fell back to the scalar pipeline
(18-83x Inductor's time on BERT's GEMM regions). Row-major, a view that only merges or splits
leading dims and keeps the last one leaves every element where it was: this module traces the
region again with every tensor in its 2-D ``(rows, last dim)`` form and those views dropped. The
compiled kernel then takes the same memory with 2-D shapes; the call hands it views of the
graph's tensors (:class:`mfusion.mlir.runtime.CompiledRegion` reshapes its descriptors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.autofuse.capability import ELEMENTWISE_OPS, MLIR_CPU_MATMUL_OPS

aten = torch.ops.aten

_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_ALLOWED = frozenset({*ELEMENTWISE_OPS, *MLIR_CPU_MATMUL_OPS, aten.permute.default})


def rows_form(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with its leading dims merged: ``(2, 128, 256) -> (256, 256)``; rank <= 2 kept."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 2:
        return shape
    return (math.prod(shape[:-1]), shape[-1])


class _NotFlat(Exception):
    """The region has an op whose meaning would change in the 2-D form."""


class _RowsInterpreter(fx.Interpreter):
    """Runs the region on 2-D tensors: leading-dim views become no-ops; element-wise ops, the
    matmul and a 2-D permute run as they are (broadcasting stays correct: an operand whose
    leading dims do not all match or all broadcast no longer broadcasts, and raises)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _VIEWS:
            source, shape = args[0], args[1]
            if tuple(source.shape) == rows_form(shape):
                return source
            raise _NotFlat(f"{target} to {list(shape)} changes the last dim")
        if target not in _ALLOWED:
            raise _NotFlat(f"{target} is not element-wise")
        if target is aten.permute.default and (args[0].dim() != 2 or len(args[1]) != 2):
            # the second: a permute of the 3-D view, whose input is 2-D in this form
            raise _NotFlat("a permute of more than two dims")
        if target in ELEMENTWISE_OPS:
            self._check_broadcast(target, [*args, *kwargs.values()])
        return super().call_function(target, args, kwargs)

    @staticmethod
    def _check_broadcast(target: Any, operands: list[Any]) -> None:
        shapes = [a.shape for a in operands if isinstance(a, torch.Tensor)]
        try:
            # checked on the sizes alone: a fake-tensor op that fails to broadcast logs its
            # whole traceback as an error, for a region that is only refused
            torch.broadcast_shapes(*shapes)  # type: ignore[no-untyped-call]
        except RuntimeError as error:
            raise _NotFlat(f"{target}: operands no longer broadcast in the 2-D form") from error


def flatten_gemm_region(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The region traced again in its 2-D form, or None when it already is 2-D or cannot be.

    Placeholders of rank > 2 become ``rows_form`` placeholders, views that only merge or split
    leading dims are dropped, outputs are returned 2-D. Anything else (a view that moves the
    last dim, a permute of 3-D data, an op other than element-wise/matmul, a broadcast that no
    longer lines up) leaves the region as it was (None).
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = [p.meta.get("val") for p in placeholders]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    if any(not isinstance(size, int) for v in values for size in v.shape):
        return None  # retraced with concrete sizes, a symbolic row count would be fixed
    has_views = any(n.op == "call_function" and n.target in _VIEWS for n in gm.graph.nodes)
    if not has_views and all(v.dim() <= 2 for v in values):
        return None

    def two_d(value: torch.Tensor) -> torch.Tensor:
        return value if value.dim() <= 2 else value.reshape(rows_form(value.shape))

    def run(*inputs: torch.Tensor) -> Any:
        results = _RowsInterpreter(gm).run(*inputs)
        if isinstance(results, torch.Tensor):  # a traced function's single result
            return two_d(results)
        return tuple(two_d(r) for r in results)

    # Traced apart from the compile this runs in: make_fx would otherwise take the outer
    # tracing context's fake mode, whose shape environment can make these sizes symbolic.
    with unset_fake_temporarily(), tracing(TracingContext(None)):
        inputs = [torch.empty(rows_form(v.shape), dtype=v.dtype) for v in values]
        try:
            flat = make_fx(run, tracing_mode="fake")(*inputs)
        except (_NotFlat, RuntimeError):
            return None
    if any(n.op == "call_function" and n.target in _VIEWS for n in flat.graph.nodes):
        return None  # an output that was not 2-D yet: a view the GEMM lowering cannot take
    return flat
