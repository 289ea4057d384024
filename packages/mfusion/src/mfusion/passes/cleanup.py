"""Housekeeping run after every rewrite: drop no-op casts and dead nodes, then lint."""

from __future__ import annotations

from torch import fx

from mfusion.passes._graph import CONVERT, cast_target, dtype_of, is_op, live_nodes


def cleanup(graph: fx.Graph) -> int:
    """Remove casts to the dtype a tensor already has and everything left unused.

    Returns:
        Number of nodes removed.
    """
    before = len(graph.nodes)
    for node in live_nodes(graph):
        source = node.args[0] if node.args else None
        if not is_op(node, CONVERT) or not isinstance(source, fx.Node):
            continue
        if dtype_of(source) == cast_target(node):  # a cast to the dtype it already has
            node.replace_all_uses_with(source)
    graph.eliminate_dead_code()
    graph.lint()
    return before - len(graph.nodes)
