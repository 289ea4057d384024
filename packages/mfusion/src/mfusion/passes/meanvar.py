"""Mean + Var of the same tensor over the same dims into one ``var_mean`` (one pass over data).

Universal (no machine check): one pass over the data instead of two, on any machine.
"""

from __future__ import annotations

import operator

from torch import fx

from mfusion.config import MFusionConfig
from mfusion.passes._graph import (
    FLOAT_DTYPES,
    aten,
    dtype_of,
    emit,
    int_list,
    is_op,
    ndim_of,
    normalized_dims,
    replace,
)
from mfusion.passes.base import MFusionPass, Refusal, Rewrite


def _mean_dims(node: fx.Node) -> tuple[object, bool]:
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return node.args[1], bool(keepdim)


class MeanVarPass(MFusionPass):
    """Anchor on ``var.correction``; pair it with a ``mean.dim`` of the same input and dims."""

    name = "meanvar"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, aten.var.correction):
            return None
        x = node.args[0]
        ndim = ndim_of(x)
        if not isinstance(x, fx.Node) or not ndim:
            # no recorded shape (or a 0-d tensor): there are no dims to compare
            return None
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.kwargs.get("keepdim", False))
        var_dims = normalized_dims(dims, ndim)
        means = [u for u in x.users if is_op(u, aten.mean.dim) and "mfusion" not in u.meta]
        if not means:
            return None
        mean = None
        for candidate in means:
            mean_dims, mean_keep = _mean_dims(candidate)
            if normalized_dims(mean_dims, ndim) != var_dims:
                continue
            if mean_keep != keepdim:
                raise Refusal("mean and var differ in keepdim: their results have other shapes")
            mean = candidate
        if mean is None:
            raise Refusal(f"mean and var of {x.name} reduce different dims")
        if mean.kwargs.get("dtype") is not None:
            raise Refusal("mean with an explicit dtype accumulates differently from var_mean")
        if dtype_of(x) not in FLOAT_DTYPES:
            raise Refusal(f"dtype {dtype_of(x)} is not a floating dtype")
        dim_list = int_list(dims)
        if dim_list is None:
            raise Refusal(f"var over dims {dims}: not a list of dims var_mean can take")
        correction = node.kwargs.get("correction", 1)

        def rewrite() -> str:
            graph = node.graph
            first = next(n for n in graph.nodes if n is mean or n is node)
            with graph.inserting_before(first):
                stats = emit(
                    graph,
                    aten.var_mean.correction,
                    x,
                    dim_list,
                    correction=correction,
                    keepdim=keepdim,
                )
                replace(node, emit(graph, operator.getitem, stats, 0))
                replace(mean, emit(graph, operator.getitem, stats, 1))
            return f"mean and var (correction={correction}) over {dim_list} as one var_mean"

        return rewrite
