"""Regions and graphs compiled by Inductor alone and run on random inputs: what the measured
choices (:mod:`mfusion.mlir.choice`, the ``linear_kernel`` pass) time and benchmarks compare.

Inputs are random tensors of the placeholders' shapes and strides, symbolic sizes at their hints;
compiles run from inside another compile (fresh tracing state, mfusion's own pass off). Which
form wins and where the answer is kept is left to :mod:`npu_core.decisions`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

Call = Callable[[], object]


def size_hint(size: int | torch.SymInt) -> int:
    """A size as a number: an int itself, a symbolic size its hint (the size the compile's
    example inputs had, which Dynamo traced with). Read without a guard."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    if hint is None:
        raise ValueError(f"symbolic size {size} has no hint (an unbacked size)")
    return int(hint)


def example_inputs(gm: fx.GraphModule) -> list[Any]:
    """Random real tensors matching the region's placeholders (fp32 normal), symbolic dims at
    their hints (:func:`size_hint`); a symbolic size placeholder becomes its hint.

    Each tensor has its placeholder's strides, not a contiguous layout: Inductor compiles a
    graph for the traced strides and asserts them on every input (``assert_size_stride``,
    ``Error in op: input``), and a backward graph reads saved tensors in other layouts (an
    attention output saved as a transposed view), so contiguous inputs failed such a graph
    before it was timed. A region is timed on the layout it reads in the graph, too."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inputs: list[Any] = []
    with unset_fake_temporarily():
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta["val"]
            if isinstance(value, torch.SymInt):
                inputs.append(size_hint(value))
                continue
            shape = [size_hint(d) for d in value.shape]
            stride = [size_hint(s) for s in value.stride()]
            inputs.append(_strided_random(shape, stride, value.dtype))
    return inputs


def _strided_random(shape: list[int], stride: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``stride`` over a fresh storage just large enough, random
    normal for a floating dtype and zeros otherwise. The storage is filled, not the view, so an
    overlapping layout (a stride-0 broadcast) is fine."""
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if dtype.is_floating_point:
        storage = torch.randn(extent, dtype=dtype)
    else:
        storage = torch.zeros(extent, dtype=dtype)
    return storage.as_strided(shape, stride)


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """Whether a placeholder of ``gm`` has a symbolic dim (or is a symbolic size)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape):
            return True
    return False


def inductor_kernel(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Call:
    """Inductor's compiled kernel for the region alone (``torch._inductor.compile``), as a call
    on ``inputs``. Compiled with fresh tracing state and without mfusion's own post-grad pass
    (which would outline the region again), so it can run inside another compile."""
    compiled = inductor_compiled(gm, inputs)
    return lambda: compiled(*inputs)


def inductor_compiled(gm: fx.GraphModule, example: list[torch.Tensor]) -> Any:
    """``gm`` compiled alone by Inductor for inputs like ``example`` (a callable taking them), the
    way :func:`inductor_kernel` compiles it: usable from inside another compile."""
    import torch._inductor
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    region = fx.GraphModule(gm, gm.graph)
    with (
        unset_fake_temporarily(),
        tracing(TracingContext(None)),
        inductor_config.patch(post_grad_custom_post_pass=None),
    ):
        inputs: list[torch.Tensor | int | torch.SymInt | None] = list(example)
        return torch._inductor.compile(region, inputs)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (node metadata shared) for a compile that rewrites it."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def graph_kernel(gm: fx.GraphModule, inputs: list[Any]) -> Call:
    """Inductor's compiled code for a whole post-grad graph, as a call on ``inputs``.

    Compiled from the post-grad stage on (``compile_fx_inner``: no second AOT trace, no second
    freezing), as the outer compile goes on with it, so frozen constants stay graph constants
    (packed weights must) and mfusion's own pass is off. A graph returning one value (a traced
    function's, not Inductor's) is changed in place to return a 1-tuple, as Inductor needs."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensor

    (output,) = gm.graph.find_nodes(op="output")
    if not isinstance(output.args[0], (tuple, list)):
        output.args = ((output.args[0],),)
        gm.recompile()
    fake_mode = next(
        (
            node.meta["val"].fake_mode
            for node in gm.graph.nodes
            if isinstance(node.meta.get("val"), FakeTensor)
        ),
        None,
    )
    with (
        tracing(TracingContext(fake_mode)),
        # Nested inside the outer compile, whose FX-graph-cache entry and Triton bundle are
        # open: this compile neither reads nor writes those caches (a second bundle cannot
        # begin while the outer one is active).
        inductor_config.patch(
            post_grad_custom_post_pass=None,
            fx_graph_cache=False,
            bundle_triton_into_fx_graph_cache=False,
        ),
    ):
        # compiled for the placeholders' fake values (as the outer compile is), run on inputs
        fakes = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
        compiled: Any = compile_fx_inner(gm, fakes)
    return lambda: compiled(list(inputs))


def graph_signature(gm: fx.GraphModule) -> str:
    """SHA-256 of a graph's structure and of every value's dtype, shape and strides: two graphs
    with the same signature compile to the same kernels. (Node names are part of it: a graph
    traced again from the same model gets the same names.)"""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        digest.update(f"{node.op}|{node.name}|{node.target}|{node.args}|{node.kwargs}".encode())
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            digest.update(f"|{value.dtype}|{tuple(value.shape)}|{value.stride()}".encode())
    return digest.hexdigest()


def timing_inputs_refusal(gm: fx.GraphModule) -> str | None:
    """Why random inputs cannot be made for ``gm``'s placeholders (None if they can): symbolic
    sizes and strides need hints (:func:`size_hint`)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            sizes: tuple[Any, ...] = (value,)
        elif isinstance(value, torch.Tensor):
            sizes = (*value.shape, *value.stride())
        else:
            return f"input {node.name} is not a tensor ({type(value).__name__})"
        try:
            for size in sizes:
                size_hint(size)
        except ValueError as error:
            return f"input {node.name}: {error}"
    return None
