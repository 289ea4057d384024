"""Convolutions whose weights are graph inputs stay NCHW where Inductor's channels-last layout
costs more than it saves on this machine.

On a CPU with oneDNN, Inductor lays out every graph that has a convolution channels-last
(``GraphLowering.decide_layout_opt``: "for cpu backend and mkldnn enabled, we always use
channels_last"). Under freezing the weights are constants, converted once at compile time. Where
they are graph inputs (every training step, and inference without freezing) the compiled graph
converts each weight on every call and runs the convolutions channels-last; in training the
backward then works on channels-last activations and weights, and each weight gradient is
converted back to the parameter's layout. On a 2-core AMD EPYC with AVX2 (one thread) that made
ResNet-18's compiled training step 2.3x slower than the same graph kept NCHW (308 vs 132 ms) and
slower than eager (145 ms): a ``[512, 512, 3, 3]`` convolution's forward and backward took 22 ms
NCHW and 68 ms channels-last with its conversions. With freezing it paid a little (ResNet-18
inference 25.7 ms channels-last, 26.7 ms NCHW).

GraphLowering takes the layout for a whole graph from its ``aten.convolution`` (and oneDNN)
nodes, so the pass decides per graph: for each distinct convolution it times what each layout
runs per call on random tensors of the graph's shapes and dtype on this machine (NCHW: the
convolution, and in a training forward graph its backward; channels-last: the weight's
conversion, the convolution on channels-last activations, and in training its backward and the
weight gradient's conversion back), sums over the graph's convolutions, and keeps NCHW only where
that takes at most ``1 - _measured.MIN_GAIN`` of channels-last's time. The activations' own
conversion at the graph's edges is not counted (it would only add to channels-last's side), nor
is how Inductor's element-wise loops run in either layout: the model benchmark is the check.
Per-convolution timings are cached per (shape, dtype, training, machine profile).

NCHW is kept by calling each convolution as ``mfusion::convolution``, an opaque op that runs
``aten.convolution``, the kernel eager runs: a graph without ``aten.convolution`` nodes stays
NCHW. On CPU Inductor calls the convolution as an external kernel in either form, so no fusion is
lost (oneDNN's convolution fusions run under freezing, which this pass leaves alone).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import cast

import torch
from torch import fx

from mfusion.config import ConvLayoutPolicy
from mfusion.machine import MachineProfile
from mfusion.passes._graph import is_op, tensor_val
from mfusion.passes._measured import MIN_GAIN, Choice, decide
from mfusion.passes.base import MFusionPass, PassContext

log = logging.getLogger("mfusion.conv_layout")

CONVOLUTION = torch.ops.aten.convolution.default
CACHE_KIND = "conv-layout"
LABELS = ("NCHW", "channels-last")

# The op GraphLowering does not count when it picks a layout; registered at ``import mfusion``,
# so that a graph served from Inductor's cache finds it.
_LIB = torch.library.Library("mfusion", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "convolution(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, "
    "SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups) -> Tensor"
)


def _convolution(*args: object) -> torch.Tensor:
    """``aten.convolution`` itself: the same kernel, the layout of its inputs."""
    return CONVOLUTION(*args)  # type: ignore[no-any-return]


_LIB.impl("convolution", _convolution, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
torch.library.register_fake("mfusion::convolution", _convolution, lib=_LIB)
NCHW_CONVOLUTION = torch.ops.mfusion.convolution.default


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """One convolution of a graph: everything its timing depends on."""

    input: tuple[int, ...]
    weight: tuple[int, ...]
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int
    dtype: str

    @classmethod
    def of(cls, node: fx.Node) -> ConvShape | str:
        """The shape of an ``aten.convolution`` node, or why it cannot be timed."""
        x, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
        x_val, w_val = tensor_val(x), tensor_val(w)
        if x_val is None or w_val is None:
            return "no fake-tensor metadata"
        lists = (x_val.shape, w_val.shape, stride, padding, dilation, output_padding)
        sizes = [_ints(v) for v in lists]
        if None in sizes or not isinstance(groups, int):
            return "symbolic shape"
        x_size, w_size, stride_, padding_, dilation_, output_padding_ = cast(
            list[tuple[int, ...]], sizes
        )
        if len(x_size) != 4:
            return f"{len(x_size) - 2}-D convolution (channels-last is a 2-D layout)"
        return cls(
            input=x_size,
            weight=w_size,
            bias=bias is not None,
            stride=stride_,
            padding=padding_,
            dilation=dilation_,
            transposed=bool(transposed),
            output_padding=output_padding_,
            groups=groups,
            dtype=str(x_val.dtype).removeprefix("torch."),
        )

    def calls(self, backward: bool) -> tuple[Callable[[], object], Callable[[], object]]:
        """(NCHW, channels-last): what each layout runs per call for this convolution, on random
        tensors of its shape. Both return the same values (the output, or the weight gradient
        when ``backward``), in their own layout."""
        dtype = getattr(torch, self.dtype)
        x = torch.randn(self.input, dtype=dtype)
        w = torch.randn(self.weight, dtype=dtype)
        b = torch.randn(self._out_channels(), dtype=dtype) if self.bias else None
        options = (
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            self.transposed,
            list(self.output_padding),
            self.groups,
        )
        grad = torch.randn_like(CONVOLUTION(x, w, b, *options))
        bias_sizes = [self._out_channels()] if self.bias else None
        wanted = [True, True, self.bias]
        last = torch.channels_last
        x_last, grad_last = x.contiguous(memory_format=last), grad.contiguous(memory_format=last)

        def nchw() -> object:
            out = CONVOLUTION(x, w, b, *options)
            if backward:
                _, grad_w, _ = torch.ops.aten.convolution_backward(
                    grad, x, w, bias_sizes, *options, wanted
                )
                return grad_w
            return out

        def channels_last() -> object:
            w_last = w.contiguous(memory_format=last)
            out = CONVOLUTION(x_last, w_last, b, *options)
            if backward:
                _, grad_w, _ = torch.ops.aten.convolution_backward(
                    grad_last, x_last, w_last, bias_sizes, *options, wanted
                )
                return grad_w.contiguous()
            return out

        return nchw, channels_last

    def _out_channels(self) -> int:
        return self.weight[1] * self.groups if self.transposed else self.weight[0]

    def describe(self) -> str:
        kind = "transposed " if self.transposed else ""
        return f"{kind}{'x'.join(map(str, self.weight))} over {'x'.join(map(str, self.input))}"


def _ints(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of Python ints; None when any entry is symbolic (or not a size)."""
    if not isinstance(value, (list, tuple, torch.Size)):
        return None
    if not all(isinstance(i, int) for i in value):
        return None
    return tuple(value)


def time_layouts(shape: ConvShape, backward: bool, machine: MachineProfile) -> Choice:
    """NCHW (candidate) against channels-last for one convolution: measured, or cached."""
    fields: dict[str, object] = {**dataclasses.asdict(shape), "backward": backward}
    choice = decide(CACHE_KIND, fields, machine, LABELS, lambda: shape.calls(backward))
    if choice.source == "measured":
        log.info("%s (backward %s): %s", shape.describe(), backward, choice.describe())
    return choice


def inductor_picks_channels_last(convolutions: list[fx.Node]) -> bool:
    """Inductor's own rule for this graph: channels-last when layout optimisation is on and every
    convolution runs on a CPU with oneDNN (it decides other devices by FLOP heuristics)."""
    import torch._inductor.config as inductor_config

    if not inductor_config.layout_optimization:
        return False
    mkldnn = torch.backends.mkldnn
    if not (mkldnn.enabled and mkldnn.is_available()):  # type: ignore[no-untyped-call]
        return False
    values = [tensor_val(arg) for node in convolutions for arg in node.args[:2]]
    return all(v is not None and v.device.type == "cpu" for v in values)


class ConvLayoutPass(MFusionPass):
    """One decision per graph over all its ``aten.convolution`` nodes."""

    name = "conv_layout"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> None:
        convolutions = [n for n in graph.nodes if is_op(n, CONVOLUTION)]
        if not convolutions or not inductor_picks_channels_last(convolutions):
            return
        shapes = [ConvShape.of(n) for n in convolutions]
        reason = self._refusal(convolutions, shapes, ctx)
        if reason is None:
            counts = collections.Counter(s for s in shapes if isinstance(s, ConvShape))
            choice = self._choose(counts, ctx)
            if choice.chosen:
                for node in convolutions:
                    node.target = NCHW_CONVOLUTION
                    node.meta["mfusion"] = self.name
                    ctx.rewrote(self.name, node, f"kept NCHW: {choice.describe()}")
                return
            reason = f"channels-last kept: {choice.describe()}"
        for node in convolutions:
            ctx.refused(self.name, node, reason)

    @staticmethod
    def _refusal(
        convolutions: list[fx.Node], shapes: list[ConvShape | str], ctx: PassContext
    ) -> str | None:
        """Why the graph's layout is not decided here (``shapes``: :meth:`ConvShape.of` of each
        convolution), or None."""
        if ctx.config.conv_layout == ConvLayoutPolicy.INDUCTOR:
            return "conv_layout=inductor"
        if ctx.is_inference is None:
            return "whether a backward follows is unknown (Inductor passes it to the manager)"
        for node, shape in zip(convolutions, shapes, strict=True):
            weight = node.args[1]
            if isinstance(weight, fx.Node) and weight.op == "get_attr":
                return "a weight is a frozen constant: Inductor converts it once, at compile time"
            if isinstance(shape, str):
                return shape
        return None

    @staticmethod
    def _choose(shapes: collections.Counter[ConvShape], ctx: PassContext) -> Choice:
        """NCHW (chosen) or channels-last for the graph: per-convolution times, summed."""
        if ctx.config.conv_layout == ConvLayoutPolicy.NCHW:
            return Choice(True, None, None, "conv_layout=nchw", *LABELS)
        machine, backward = ctx.config.resolved_machine(), not ctx.is_inference
        nchw_s = channels_last_s = 0.0
        sources = set()
        for shape, count in shapes.items():
            choice = time_layouts(shape, backward, machine)
            if choice.candidate_s is None or choice.baseline_s is None:
                return choice  # not timed (NPU_CORE_DECISIONS): Inductor's layout
            nchw_s += count * choice.candidate_s
            channels_last_s += count * choice.baseline_s
            sources.add(choice.source)
        chosen = nchw_s <= (1 - MIN_GAIN) * channels_last_s
        source = "/".join(sorted(sources)) + f", {sum(shapes.values())} convolutions"
        return Choice(chosen, nchw_s, channels_last_s, source, *LABELS)
