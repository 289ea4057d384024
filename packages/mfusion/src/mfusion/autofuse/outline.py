"""Outline a region: extract it as a stand-alone graph module and replace it by one call."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.node import Argument

from mfusion.autofuse.split import insertion_window


@dataclasses.dataclass
class OutlinedRegion:
    """A region as a graph module of its own, with the outer nodes it reads and produces."""

    module: fx.GraphModule
    inputs: list[fx.Node]
    """Outer nodes the region reads, in placeholder order."""
    outputs: list[fx.Node]
    """Region nodes used outside it, in the order of the module's output tuple."""
    nodes: list[fx.Node]


def extract_region(nodes: Sequence[fx.Node]) -> OutlinedRegion:
    """Copy ``nodes`` (graph order) into a new graph whose placeholders are the outer inputs."""
    members = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    for node in nodes:
        for producer in node.all_input_nodes:
            if producer not in members and producer not in env:
                placeholder = graph.placeholder(producer.name)
                placeholder.meta["val"] = producer.meta.get("val")
                env[producer] = placeholder
                inputs.append(producer)
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return OutlinedRegion(fx.GraphModule(torch.nn.Module(), graph), inputs, outputs, list(nodes))


def replace_with_call(
    graph: fx.Graph,
    region: OutlinedRegion,
    target: Callable[..., Any],
    extra_args: tuple[Argument, ...],
) -> fx.Node:
    """Replace the region by ``target(inputs, *extra_args)`` returning a list of its outputs.

    The call is placed right before the first outside user of a region output, which the caller
    has checked lies after every producer of a region input (see ``split``).
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    lo, hi = insertion_window(region.nodes, order)
    if lo >= hi:
        raise ValueError("region has no legal insertion point; split it first")
    position = next(n for n in graph.nodes if order[n] == hi)
    with graph.inserting_before(position):
        call = graph.call_function(target, (list(region.inputs), *extra_args))
        call.meta["val"] = [o.meta["val"] for o in region.outputs]
        for index, old in enumerate(region.outputs):
            item = graph.call_function(operator.getitem, (call, index))
            item.meta["val"] = old.meta["val"]
            old.replace_all_uses_with(item, delete_user_cb=lambda user: user is not call)
    for node in reversed(region.nodes):
        graph.erase_node(node)
    return call
