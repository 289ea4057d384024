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
        if is_op(node, CONVERT) and dtype_of(node.args[0]) == cast_target(node):
            node.replace_all_uses_with(node.args[0])
    graph.eliminate_dead_code()
    graph.lint()
    return before - len(graph.nodes)
