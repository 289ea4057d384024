"""Which activation a linear's output goes through, recognised by what the graph computes.

Inductor's decompositions spell one activation several ways in a post-grad graph: erf-GELU as
``x * 0.5 * (erf(x * 0.7071) + 1)`` in either association, tanh-GELU with ``x * x * x`` or
``pow(x, 3)``, SiLU as ``x * sigmoid(x)`` (after the ``swiglu`` pass) or ``x / (1 + exp(-x))``.
What a GEMM library's fused epilogue needs to know is not the spelling but the function, so
:func:`activation_after` collects the element-wise subgraph that reads only ``x`` (and numbers)
and has one output, evaluates it on a dense grid over [-12, 12] plus points where the candidates'
tails differ, and names the candidate it equals to fp32 rounding. The candidates differ from one
another by at least 1e-4 on that grid (erf- against tanh-GELU is the closest pair), ten times the
tolerance, and the ops allowed into the subgraph are smooth or piecewise at 0 (no comparisons, no
``where``), so agreement on the grid is agreement on the activation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx

from mfusion.passes._graph import aten, is_float_scalar

POINTWISE = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.neg.default,
        aten.reciprocal.default,
        aten.pow.Tensor_Scalar,
        aten.exp.default,
        aten.erf.default,
        aten.tanh.default,
        aten.sigmoid.default,
        aten.relu.default,
    }
)
"""Ops an activation subgraph may contain: element-wise, shape-preserving with number operands."""

PROBE_TOLERANCE = 1e-5
"""Allowed ``|f(x) - activation(x)| / (1 + |activation(x)|)`` on the probe grid: fp32 rounding of
a five-op decomposition is ~1e-7; the closest two candidates differ by 1e-4."""


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation oneDNN's linear can apply to its output tile (a unary post-op)."""

    name: str
    reference: Callable[[torch.Tensor], torch.Tensor]
    """Eager ATen form: the probe's reference, and what ``linear_kernel`` compiles alone to time
    the unfused GEMM + activation against oneDNN's fused GEMM."""
    attr: str
    algorithm: str

    def onednn_args(self) -> tuple[str, list[float], str]:
        """``attr, scalars, algorithm`` of ``mkldnn._linear_pointwise``."""
        return self.attr, [], self.algorithm


ACTIVATIONS = (
    Activation("relu", F.relu, "relu", ""),
    Activation("gelu", F.gelu, "gelu", "none"),
    Activation("gelu-tanh", functools.partial(F.gelu, approximate="tanh"), "gelu", "tanh"),
    Activation("silu", F.silu, "swish", ""),
)


def _probe() -> torch.Tensor:
    grid = torch.linspace(-12.0, 12.0, 4801)
    tails = torch.tensor([-80.0, -30.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 30.0, 80.0])
    return torch.cat([grid, tails])


def _subgraph(x: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """The element-wise nodes computed from ``x`` alone, in graph order, and their one output;
    None when ``x`` is also read elsewhere or the subgraph has several outputs."""
    members: set[fx.Node] = set()
    grown = True
    while grown:
        grown = False
        for source in (x, *members):
            for user in source.users:
                if user in members or user.target not in POINTWISE or user.kwargs:
                    continue
                inputs = [a for a in user.args if isinstance(a, fx.Node)]
                numbers_only = all(isinstance(a, fx.Node) or is_float_scalar(a) for a in user.args)
                if numbers_only and all(a is x or a in members for a in inputs):
                    members.add(user)
                    grown = True
    if not members or any(user not in members for user in x.users):
        return None
    outputs = [n for n in members if any(user not in members for user in n.users)]
    if len(outputs) != 1:
        return None
    order = [n for n in x.graph.nodes if n in members]
    return order, outputs[0]


def _evaluate(
    nodes: list[fx.Node], x: fx.Node, output: fx.Node, probe: torch.Tensor
) -> torch.Tensor:
    """``output`` for ``x = probe``: the subgraph's nodes run eagerly in graph order."""
    env: dict[fx.Node, torch.Tensor] = {x: probe}
    for node in nodes:
        args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
        assert callable(node.target)
        env[node] = node.target(*args)
    return env[output]


def activation_after(x: fx.Node) -> tuple[Activation, fx.Node] | None:
    """The activation applied to ``x`` and the node holding its result, or None."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    found = _subgraph(x)
    if found is None:
        return None
    nodes, output = found
    probe = _probe()
    with unset_fake_temporarily(), torch.no_grad():
        try:
            values = _evaluate(nodes, x, output, probe)
        except (RuntimeError, TypeError):
            return None
        for activation in ACTIVATIONS:
            expected = activation.reference(probe)
            error = (values - expected).abs() / (1 + expected.abs())
            if values.shape == expected.shape and bool(error.max() <= PROBE_TOLERANCE):
                return activation, output
    return None
