"""Frozen fp32 linears on the GEMM library that is faster on this machine: MKL's or oneDNN's.

Under freezing, Inductor packs every static-shape fp32 linear weight for MKL on x86
(``mkl._mkl_linear``) and every bf16/fp16 or dynamic-batch one for oneDNN
(``mkldnn._linear_pointwise``). Which library multiplies fp32 faster depends on the CPU (and
on what else runs on it), not on the dtype: on a 2-core AMD EPYC with AVX2, one thread,
oneDNN's packed GEMM took 0.85-0.90x of MKL's time at the real models' larger shapes while the
other core was busy, but tied at several of them with the machine idle; models built from
``transformers`` ran 1.00-1.22x faster with the choice (decoders 1.07-1.13x in both runs).
Elsewhere MKL may win.

So the pass does not carry a rule: per linear shape it times both packed GEMMs on random inputs
of that shape on the machine it runs on (interleaved rounds, medians, the same timer as the
``mlir-cpu`` choice) and moves the linear to oneDNN only when oneDNN is at least
``_measured.MIN_GAIN`` faster. Decisions are cached on disk per (shape, machine profile), so
a second compile on the same machine measures nothing. The weight is packed for oneDNN once, at
compile time, from the frozen constant, and shared by every linear that reads it.

Where the linear's output goes only through an activation oneDNN can apply to its output tile
(ReLU, erf- or tanh-GELU, SiLU; recognised by what the subgraph computes, see
:mod:`mfusion.passes._activation`) and that activation is a loop of its own in Inductor's code
(its result feeds the next GEMM, as in a transformer MLP, not another element-wise op), a second
measurement times oneDNN's GEMM with the activation fused against the unfused GEMM the first
one picked followed by the activation as Inductor compiles it (in the ``rational`` pass's form
where that pass runs afterwards); a fused form at least ``_measured.MIN_GAIN`` faster
replaces both, applying the activation while the tile is in registers instead of in a second
pass over the result.

``MFusionConfig.linear_kernel``: ``measure`` (default), ``onednn`` (always, where the form
allows), ``inductor`` (keep MKL). Inference only: the MKL form exists only for frozen weights.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import fx

from mfusion.backends.registry import BackendName
from mfusion.config import LinearKernelPolicy, MFusionConfig
from mfusion.machine import MachineProfile
from mfusion.passes._activation import Activation, activation_after
from mfusion.passes._graph import fake_mode_of, is_op, replace, tensor_val
from mfusion.passes._measured import Choice, decide
from mfusion.passes.base import MFusionPass, Refusal, Rewrite
from mfusion.passes.registry import PASS_REGISTRY

log = logging.getLogger("mfusion.linear_kernel")

MKL_LINEAR = (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default)
ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default
ONEDNN_PACK = torch.ops.mkldnn._reorder_linear_weight.default


CACHE_KIND = "linear-kernel"
"""The GEMM-library decisions' folder under ``$MFUSION_CACHE_DIR``."""


@dataclasses.dataclass
class _Operands:
    """Random inputs of one linear shape and its weight packed for both libraries."""

    m: int
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    mkl_packed: torch.Tensor
    onednn_packed: torch.Tensor

    @classmethod
    def random(cls, m: int, k: int, n: int, bias: bool) -> _Operands:
        weight = torch.randn(n, k)
        return cls(
            m,
            torch.randn(m, k),
            weight,
            torch.randn(n) if bias else None,
            torch.ops.mkl._mkl_reorder_linear_weight(weight, m),
            ONEDNN_PACK(weight, m),
        )

    def mkl(self) -> torch.Tensor:
        out = torch.ops.mkl._mkl_linear(self.x, self.mkl_packed, self.weight, self.bias, self.m)
        return out  # type: ignore[no-any-return]

    def onednn(self, activation: Activation | None = None) -> torch.Tensor:
        epilogue = activation.onednn_args() if activation is not None else ("none", [], "")
        out = ONEDNN_LINEAR(self.x, self.onednn_packed, self.bias, *epilogue)
        return out  # type: ignore[no-any-return]


def _decide(
    mkn: tuple[int, int, int],
    bias: bool,
    extra: dict[str, str],
    policy: str,
    machine: MachineProfile,
    labels: tuple[str, str],
    calls: Callable[[_Operands], tuple[Callable[[], object], Callable[[], object]]],
) -> Choice:
    """The candidate where ``policy`` forces it; otherwise time ``calls(operands) = (candidate,
    baseline)`` on random operands of shape ``mkn`` (or read the cached decision), and the
    candidate wins at :data:`~mfusion.passes._measured.MIN_GAIN` or more."""
    if policy != LinearKernelPolicy.MEASURE:
        forced = policy == LinearKernelPolicy.ONEDNN
        return Choice(forced, None, None, f"linear_kernel={policy}", *labels)
    fields: dict[str, object] = {"mkn": list(mkn), "bias": bias, **extra}
    choice = decide(
        CACHE_KIND, fields, machine, labels, lambda: calls(_Operands.random(*mkn, bias))
    )
    if choice.source == "measured":
        log.info("linear %s (bias %s): %s", "x".join(map(str, mkn)), bias, choice.describe())
    return choice


def choose(m: int, k: int, n: int, bias: bool, policy: str, machine: MachineProfile) -> Choice:
    """oneDNN (chosen) or MKL for a frozen fp32 linear ``[m, k] x [n, k]^T`` on ``machine``."""

    def calls(ops: _Operands) -> tuple[Callable[[], object], Callable[[], object]]:
        return ops.onednn, ops.mkl

    return _decide((m, k, n), bias, {}, policy, machine, ("oneDNN", "MKL"), calls)


def choose_fused(
    m: int,
    k: int,
    n: int,
    bias: bool,
    policy: str,
    machine: MachineProfile,
    activation: Activation,
    unfused_onednn: bool,
    rational: bool,
) -> Choice:
    """Whether oneDNN's GEMM with ``activation`` fused beats the unfused linear (the library
    :func:`choose` picked, ``unfused_onednn``) followed by the activation as a separate loop.

    The separate loop is timed as Inductor compiles it alone, in the form the graph will run:
    with its erf/tanh as rational functions where ``rational`` (the ``rational`` pass runs after
    this one), which takes tanh-GELU to a third of the time of Inductor's own loop. Timing the
    eager ATen kernel instead (as 0.5.0 did) made fusing look better than it is once that pass
    has run."""
    library = "oneDNN" if unfused_onednn else "MKL"
    labels = (f"oneDNN + {activation.name} fused", f"{library}, then {activation.name}")
    loop = "rational" if rational else "inductor"
    extra = {"activation": activation.name, "unfused": library, "loop": loop}

    def calls(ops: _Operands) -> tuple[Callable[[], object], Callable[[], object]]:
        unfused = ops.onednn if unfused_onednn else ops.mkl
        apply = _activation_loop(activation, unfused(), rational)
        return (lambda: ops.onednn(activation)), (lambda: apply(unfused()))

    return _decide((m, k, n), bias, extra, policy, machine, labels, calls)


def _activation_loop(
    activation: Activation, example: torch.Tensor, rational: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Inductor's compiled loop for ``activation`` alone on tensors like ``example``, with the
    ``rational`` pass applied first where ``rational``."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from mfusion.mlir.standalone import inductor_compiled
    from mfusion.passes.base import PassContext
    from mfusion.passes.rational import RationalPass
    from mfusion.report import GraphReport

    def loop(y: torch.Tensor) -> torch.Tensor:  # one argument: make_fx traces every parameter
        return activation.reference(y)

    gm = make_fx(loop, decomposition_table=select_decomp_table())(example)
    if rational:
        # A record of its own, not the user's report: this graph is a measurement, not theirs.
        context = PassContext(MFusionConfig(backend="inductor"), GraphReport(-1, "inductor"))
        RationalPass()(gm.graph, context)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    loop_kernel: Callable[[torch.Tensor], torch.Tensor] = inductor_compiled(gm, [example])
    return loop_kernel


def rational_runs_after(config: MFusionConfig) -> bool:
    """Whether the ``rational`` pass runs after ``linear_kernel`` in this configuration (it
    rewrites only for the inductor backend)."""
    names = config.passes if config.passes is not None else tuple(PASS_REGISTRY)
    if "rational" not in names or "linear_kernel" not in names:
        return False
    after = names.index("rational") > names.index("linear_kernel")
    return after and config.resolved_backend() is BackendName.INDUCTOR


class LinearKernelPass(MFusionPass):
    """Anchor on ``mkl._mkl_linear(x, packed, weight, bias, batch)`` of a frozen weight."""

    name = "linear_kernel"

    def match_at(self, node: fx.Node, config: MFusionConfig) -> Rewrite | None:
        if not is_op(node, *MKL_LINEAR):
            return None
        x, _packed, weight, bias = node.args[:4]
        x_val, w_val = tensor_val(x), tensor_val(weight)
        if x_val is None or w_val is None or not isinstance(weight, fx.Node):
            return None
        root = node.graph.owning_module
        if weight.op != "get_attr" or root is None:
            raise Refusal("the weight is not a frozen constant of the graph module")
        if x_val.dtype != torch.float32 or x_val.dim() != 2 or x_val.device.type != "cpu":
            raise Refusal(f"input {x_val.dtype} {x_val.dim()}-D on {x_val.device.type}")
        if not all(isinstance(s, int) for s in (*x_val.shape, *w_val.shape)):
            raise Refusal("symbolic shape: oneDNN's packing is per batch size")
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            raise Refusal("this torch build has no oneDNN")
        (m, k), n = x_val.shape, w_val.shape[0]
        machine, has_bias = config.resolved_machine(), bias is not None
        plain = choose(m, k, n, has_bias, config.linear_kernel, machine)
        epilogue = _epilogue(node)
        if epilogue is not None:
            fused = choose_fused(
                m,
                k,
                n,
                has_bias,
                config.linear_kernel,
                machine,
                epilogue.activation,
                plain.chosen,
                rational_runs_after(config),
            )
            if fused.chosen:
                return self._rewrite(node, root, weight, (m, k, n), fused, epilogue)
        if not plain.chosen:
            raise Refusal(f"MKL kept: {plain.describe()}")
        return self._rewrite(node, root, weight, (m, k, n), plain, None)

    @staticmethod
    def _rewrite(
        node: fx.Node,
        root: torch.nn.Module,
        weight: fx.Node,
        mkn: tuple[int, int, int],
        choice: Choice,
        epilogue: Epilogue | None,
    ) -> Rewrite:
        x, bias = node.args[0], node.args[3]

        def rewrite() -> str:
            packed = _packed_constant(root, weight, mkn[0])
            shape = "x".join(map(str, mkn))
            if epilogue is None:
                new = node.graph.call_function(ONEDNN_LINEAR, (x, packed, bias, "none", [], ""))
                new.meta["val"] = node.meta["val"]
                replace(node, new)
                return f"oneDNN packed GEMM {shape}: {choice.describe()}"
            activation, view = epilogue.activation, epilogue.view
            args = (x, packed, bias, *activation.onednn_args())
            new = node.graph.call_function(ONEDNN_LINEAR, args)
            new.meta["val"] = node.meta["val"]
            if view is not None:  # the activation read a reshape of the GEMM's 2-D result
                new = node.graph.call_function(RESHAPE, (new, view.args[1]))
                new.meta["val"] = view.meta["val"]
            replace(epilogue.output, new)
            return f"oneDNN packed GEMM {shape} + {activation.name}: {choice.describe()}"

        return rewrite


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """The activation behind a linear: what it is, the reshape of the GEMM's 2-D result it reads
    (if any), and the node holding its result (the one the fused GEMM replaces)."""

    activation: Activation
    view: fx.Node | None
    output: fx.Node


RESHAPE = torch.ops.aten.reshape.default
RESHAPES = (RESHAPE, torch.ops.aten.view.default)


def _epilogue(linear: fx.Node) -> Epilogue | None:
    """The activation the linear's output (or a reshape of it back to 3-D) alone feeds."""
    view = None
    source = linear
    if len(linear.users) == 1:
        (user,) = linear.users
        if is_op(user, *RESHAPES):
            view = source = user
    found = activation_after(source)
    if found is None or not _own_loop(found[1]):
        return None
    activation, output = found
    return Epilogue(activation, view, output)


GEMMS = (*MKL_LINEAR, ONEDNN_LINEAR, torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _own_loop(activation: fx.Node) -> bool:
    """True when Inductor would give the activation a loop of its own: its result (or a reshape
    of it) only feeds GEMMs or leaves the graph. Where it feeds another element-wise op (SwiGLU's
    product, a residual add), Inductor computes it inside that op's loop, so fusing it into the
    GEMM saves no pass over memory, and timing it as a separate loop would overstate the gain."""
    for user in activation.users:
        if user.op == "output" or is_op(user, *GEMMS):
            continue
        if not (is_op(user, *RESHAPES) and _own_loop(user)):
            return False
    return True


def _packed_constant(root: torch.nn.Module, weight: fx.Node, batch: int) -> fx.Node:
    """A ``get_attr`` of ``weight`` packed for oneDNN at ``batch`` rows, made once per weight."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    assert isinstance(weight.target, str)
    name = f"_mfusion_onednn_{weight.target.replace('.', '_')}_{batch}"
    graph = weight.graph
    if not hasattr(root, name):
        with unset_fake_temporarily(), torch.no_grad():
            value = ONEDNN_PACK(getattr_path(root, weight.target), batch)
        root.register_buffer(name, value, persistent=False)
    for existing in graph.find_nodes(op="get_attr"):
        if isinstance(existing, fx.Node) and existing.target == name:
            return existing
    with graph.inserting_after(weight):
        node = graph.get_attr(name)
    fake_mode = fake_mode_of(graph)
    value = getattr(root, name)
    node.meta["val"] = fake_mode.from_tensor(value) if fake_mode is not None else value
    return node


def getattr_path(root: torch.nn.Module, target: str) -> torch.Tensor:
    """``root.a.b.c`` for ``target="a.b.c"`` (how ``get_attr`` nodes name their constants)."""
    value: object = root
    for part in target.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value
