"""Threads for JIT-compiled regions: rows of the outermost dimension split across threads.

The installed torch-mlir wheel ships no OpenMP or async runtime the ExecutionEngine could load
(``convert-scf-to-openmp`` would need ``libomp``'s ``__kmpc_*`` entry points; the GNU libgomp
that torch loads does not export them). So threading is done outside the kernel: a region whose
rows are independent along dimension 0 is compiled once more for ``rows / threads`` rows, and
the call runs that kernel on each block of rows from a thread pool. A ctypes call releases the
GIL, so the blocks run in parallel. A region with symbolic dims is one kernel for every size
already: its blocks run that same kernel, cut per call from the actual row count
(:func:`block_bounds`), so a row count that does not divide evenly gets blocks one row apart.

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


Rows = int | torch.SymInt


def same_size(a: object, b: object) -> bool:
    """Whether two sizes are the same: equal ints, or SymInts of the same expression. Compared
    without ``==`` on SymInts, which would add a guard to the compile's shape environment."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)
    return isinstance(a, int) and isinstance(b, int) and a == b


def row_split(gm: fx.GraphModule) -> Rows | None:
    """The number of independent rows along dimension 0 of ``gm``'s outputs (a SymInt when
    dimension 0 is symbolic), or None if some op mixes rows."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    values = [tensor_val(n) for n in nodes]
    if not nodes or any(v is None for v in values):
        return None
    ranks = {v.dim() for v in values if v is not None}
    if len(ranks) != 1 or 0 in ranks:
        return None
    rank = ranks.pop()
    rows = values[0].shape[0] if values[0] is not None else None
    if any(v is None or not same_size(v.shape[0], rows) for v in values):
        return None
    if rank < 2 or not _splittable(rows):
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
            if not isinstance(size, (list, tuple)) or not same_size(_size(size[0]), rows):
                return None
        elif node.target is aten.unsqueeze.default:
            return None  # changes the rank: excluded by the rank check anyway
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        value = tensor_val(placeholder)
        if value is None:
            return None
        if value.dim() == rank and not (
            same_size(value.shape[0], rows) or same_size(value.shape[0], 1)
        ):
            return None
        if value.dim() > rank:
            return None
    return rows


def _splittable(rows: object) -> bool:
    """Rows worth splitting: a symbolic count (decided per call), or a static one of 2 or more."""
    return isinstance(rows, torch.SymInt) or (isinstance(rows, int) and rows >= 2)


def _size(value: object) -> object:
    """A view's size argument as a size: an FX node's value (a SymInt) or the int itself."""
    return value.meta.get("val") if isinstance(value, fx.Node) else value


def split_inputs(gm: fx.GraphModule, rows: Rows) -> list[bool]:
    """For each placeholder: True if it is split with the rows, False if passed whole."""
    flags = []
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        value = tensor_val(placeholder)
        assert value is not None
        flags.append(
            value.dim() >= 2 and same_size(value.shape[0], rows) and value.dim() == _rank(gm)
        )
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


def block_bounds(rows: int, blocks: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each of at most ``blocks`` row blocks covering ``rows`` rows, the
    lengths at most one apart (no empty block: fewer rows than blocks gives one-row blocks)."""
    count = max(1, min(blocks, rows))
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for index in range(count):
        length = base + (1 if index < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


_POOL: list[concurrent.futures.ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A process-wide thread pool with at least ``workers`` threads."""
    with _POOL_LOCK:
        if not _POOL or _POOL[-1]._max_workers < workers:
            _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=workers))
        return _POOL[-1]
