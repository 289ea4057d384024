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


def snapshot(graph: fx.Graph) -> fx.GraphModule:
    """A copy of ``graph`` as a graph module over the same root (its constants are shared, not
    copied), for compiling and timing it apart from the graph being rewritten."""
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "output":
            copy.output(fx.map_arg(node.args[0], env.__getitem__)).meta = dict(node.meta)
        else:
            env[node] = copy.node_copy(node, env.__getitem__)
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return fx.GraphModule(root, copy)


def inline_call(graph: fx.Graph, call: fx.Node, region: OutlinedRegion) -> None:
    """Undo :func:`replace_with_call`: put the region's nodes back in place of ``call`` (before
    it, where every input is defined), rewire the users of its outputs, erase the call.

    The copies carry the region nodes' metadata (fake values), so later passes and Inductor see
    the graph as it was. Undo several calls in reverse order of outlining: a later region may
    read an earlier one's outputs.
    """
    env: dict[fx.Node, fx.Node] = {}
    placeholders = region.module.graph.find_nodes(op="placeholder")
    env.update(zip(placeholders, region.inputs, strict=True))
    results: tuple[fx.Node, ...] = ()
    with graph.inserting_before(call):
        for node in region.module.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = tuple(node.args[0])  # a tuple of nodes, as extract_region built it
                break
            env[node] = graph.node_copy(node, env.__getitem__)
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise ValueError(f"{call.name} is used by {user.name}, not an output getitem")
        user.replace_all_uses_with(env[results[int(user.args[1])]])  # type: ignore[arg-type]
        graph.erase_node(user)
    graph.erase_node(call)
