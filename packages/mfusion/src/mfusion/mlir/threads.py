"""Threads for JIT-compiled regions: rows of the outermost dimension split across threads.

The installed torch-mlir wheel ships no OpenMP or async runtime the ExecutionEngine could load
(``convert-scf-to-openmp`` would need ``libomp``'s ``__kmpc_*`` entry points; the GNU libgomp
that torch loads does not export them). So threading is done outside the kernel: a region whose
rows are independent along dimension 0 is compiled once more for ``rows / threads`` rows, and
the call runs that kernel on each block of rows from a thread pool. A ctypes call releases the
GIL, so the blocks run in parallel.

A region qualifies (:func:`row_split`) when every op in it keeps dimension 0 as the row index:
all its values have the same rank and the same leading size, reductions and permutes leave
dimension 0 alone, views keep the leading size, and each input is either split with the rows
(same rank, same leading size), broadcast along them (leading size 1) or of lower rank (aligned
to the trailing dimensions, so it never meets dimension 0).
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch
from torch import fx

from mfusion.passes._graph import aten, tensor_val

_REDUCE = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)
_SIZED = (aten.view.default, aten.reshape.default, aten.expand.default)
# A matmul's output row i reads every row of its second operand: with K == M the row test below
# would split that operand with the rows. Matmul regions run on one thread.
_MATMUL = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def row_split(gm: fx.GraphModule) -> int | None:
    """The number of independent rows along dimension 0 of ``gm``'s outputs, or None if some
    op mixes rows (or shapes are symbolic)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    values = [tensor_val(n) for n in nodes]
    if not nodes or any(v is None for v in values):
        return None
    ranks = {v.dim() for v in values if v is not None}
    leading = {v.shape[0] if v.dim() else None for v in values if v is not None}
    if len(ranks) != 1 or len(leading) != 1:
        return None
    rank, rows = ranks.pop(), leading.pop()
    if rank < 2 or not isinstance(rows, int) or rows < 2:
        return None
    for node in nodes:
        if node.target in _MATMUL:
            return None
        if node.target in _REDUCE:
            dims = node.args[1] if len(node.args) > 1 else None
            if not isinstance(dims, (list, tuple)) or any(
                not isinstance(d, int) or d % rank == 0 for d in dims
            ):
                return None
        elif node.target is aten.permute.default:
            perm = node.args[1]
            if not isinstance(perm, (list, tuple)) or perm[0] % rank != 0:
                return None
        elif node.target in _SIZED:
            size = node.args[1]
            if not isinstance(size, (list, tuple)) or size[0] != rows:
                return None
        elif node.target is aten.unsqueeze.default:
            return None  # changes the rank: excluded by the rank check anyway
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        value = tensor_val(placeholder)
        if value is None or not all(isinstance(s, int) for s in value.shape):
            return None
        if value.dim() == rank and value.shape[0] not in (rows, 1):
            return None
        if value.dim() > rank:
            return None
    return rows


def split_inputs(gm: fx.GraphModule, rows: int) -> list[bool]:
    """For each placeholder: True if it is split with the rows, False if passed whole."""
    flags = []
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        value = tensor_val(placeholder)
        assert value is not None
        flags.append(value.dim() >= 2 and value.shape[0] == rows and value.dim() == _rank(gm))
    return flags


def _rank(gm: fx.GraphModule) -> int:
    for node in gm.graph.nodes:
        if node.op == "call_function":
            value = tensor_val(node)
            if value is not None:
                return value.dim()
    return 0


def block_module(gm: fx.GraphModule, rows: int, block: int) -> fx.GraphModule:
    """``gm`` re-traced for ``block`` rows instead of ``rows`` (view sizes adjusted), with
    fake-tensor metadata like the original, ready for ``import_region``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, env.__getitem__)
        if node.op == "call_function" and node.target in _SIZED:
            size = list(node.args[1])  # type: ignore[arg-type,unused-ignore]
            size[0] = block
            new.args = (new.args[0], size, *new.args[2:])
        env[node] = new
    adjusted = fx.GraphModule(gm, graph)
    flags = split_inputs(gm, rows)
    inputs = []
    for placeholder, split in zip(gm.graph.find_nodes(op="placeholder"), flags, strict=True):
        value = tensor_val(placeholder)
        assert value is not None
        shape = [block, *value.shape[1:]] if split else list(value.shape)
        inputs.append(torch.zeros(shape, dtype=value.dtype))
    return make_fx(adjusted, tracing_mode="fake")(*inputs)


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide thread pool with at least ``workers`` threads."""
    with _POOL_LOCK:
        if not _POOL or _POOL[-1]._max_workers < workers:
            _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=workers))
        return _POOL[-1]
