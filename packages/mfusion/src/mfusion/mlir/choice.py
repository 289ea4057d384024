"""Measured per-region choice between the MLIR kernel and Inductor's kernel, cached on disk.

An MLIR kernel is an opaque call Inductor cannot fuse around, and whether it beats Inductor's
own kernel depends on the region (exp-heavy rows: often; erf, short rows: not) and on the
machine. So every region the ``mlir-cpu`` backend compiles is timed against Inductor's kernel
for the same region on the machine it runs on, and outlined only where the MLIR kernel is not
slower; otherwise it stays in the graph for Inductor.

- **What is timed.** The MLIR side is the JIT-compiled kernel writing into preallocated outputs
  (as ``mfusion::mlir_region`` runs it, minus the output allocation). The Inductor side is the
  region's own FX graph compiled by Inductor standalone (``torch._inductor.compile``, one
  kernel for an element-wise/reduce region), called with the same inputs. Inputs are random
  normal tensors of the region's static shapes. A region with symbolic dims (one MLIR kernel
  for every size) is timed at the sizes the compile traced with (the symbols' hints) against
  Inductor's kernel for the region compiled with the same symbolic sizes: the decision taken at
  that size holds for every size the compiled graph later runs.
- **How.** Interleaved samples of about :data:`SAMPLE_S` each, alternating which side goes
  first, for :data:`ROUNDS` rounds; the decision compares medians of the per-round times.
- **Cache.** One JSON file per (region IR hash, pipeline, machine profile fingerprint), under
  ``$MFUSION_CACHE_DIR/mlir-choice`` (default ``$XDG_CACHE_HOME/mfusion`` or
  ``~/.cache/mfusion``). A hit costs one file read; a new machine profile (another CPU, ISA
  cap or thread count) measures again.
- **Override.** ``MFUSION_MLIR_CHOICE=measure`` (default), ``always`` (outline every region
  the JIT compiles: 0.3.1's behaviour, used by tests of the outlining itself) or ``never``.
  Inductor's FX graph cache key does not see this variable: use a fresh
  ``TORCHINDUCTOR_CACHE_DIR`` after changing it.

Every decision is logged (logger ``mfusion.mlir``) with both times and where it came from.

**Whole-graph check** (:func:`decide_graph`). A region measured faster alone can still cost the
model time: Inductor had fused it with its neighbours, and the opaque call splits that fusion
(one more pass over memory). So once regions of a graph are outlined, the graph is compiled by
Inductor twice, with and without them, both timed on the same random inputs
(:data:`GRAPH_ROUNDS` interleaved rounds of about :data:`GRAPH_SAMPLE_S`), and the outlined
form is kept only if it is faster; otherwise every region is put back for Inductor. Cached like
the region decisions, per (both graphs' structure and shapes, machine profile).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from mfusion import env
from mfusion.machine import MachineProfile

log = logging.getLogger("mfusion.mlir")

ROUNDS = 7
"""Interleaved rounds per decision (odd, so the median is one measured round)."""

SAMPLE_S = 0.002
"""Target length of one timed sample (calls are batched up to it); ~ROUNDS x 2 x 2 ms per region."""

GRAPH_ROUNDS = 9
"""Interleaved rounds of the whole-graph check (odd)."""

GRAPH_SAMPLE_S = 0.02
"""Target length of one whole-graph sample: a graph call takes milliseconds, and one call per
sample is at the mercy of every scheduler tick."""

CHOICES = ("measure", "always", "never")

Call = Callable[[], object]
Timer = Callable[[Call, Call], tuple[float, float]]
"""``timer(mlir_call, inductor_call) -> (mlir_seconds, inductor_seconds)`` per call."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one region runs as the MLIR kernel, and the measurement behind it."""

    use_mlir: bool
    mlir_s: float | None
    """Seconds per call of the MLIR kernel (None when not measured)."""
    inductor_s: float | None
    """Seconds per call of Inductor's kernel for the same region (None when not measured)."""
    source: str
    """``measured``, ``cache`` or ``MFUSION_MLIR_CHOICE=<value>``."""

    @property
    def ratio(self) -> float | None:
        """MLIR time / Inductor time (below 1: MLIR faster)."""
        if self.mlir_s is None or not self.inductor_s:
            return None
        return self.mlir_s / self.inductor_s

    def describe(self) -> str:
        """One line for the report and the log."""
        if self.ratio is None:
            return f"{'mlir' if self.use_mlir else 'inductor'} ({self.source})"
        assert self.mlir_s is not None and self.inductor_s is not None
        winner = "mlir" if self.use_mlir else "inductor"
        return (
            f"{winner}: mlir {self.mlir_s * 1e6:.1f} us vs inductor {self.inductor_s * 1e6:.1f} us"
            f" (ratio {self.ratio:.2f}, {self.source})"
        )


def choice_mode() -> str:
    """``MFUSION_MLIR_CHOICE`` (default ``measure``).

    Raises:
        ValueError: the variable holds something else; names the value and what is allowed.
    """
    mode = env.mlir_choice()
    if mode not in CHOICES:
        raise ValueError(f"MFUSION_MLIR_CHOICE={mode!r} is not known; use one of {list(CHOICES)}")
    return mode


def cache_dir() -> Path:
    """Where decisions are kept: ``$MFUSION_CACHE_DIR/mlir-choice``, else under
    ``$XDG_CACHE_HOME/mfusion`` or ``~/.cache/mfusion``."""
    return env.cache_root() / "mlir-choice"


class DecisionCache:
    """Decisions on disk, one small JSON file per (region, pipeline, machine) key.

    Files are written to a temporary name and renamed, so concurrent compiles never read half a
    file; an unreadable file counts as a miss.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else cache_dir()

    @staticmethod
    def key(region_hash: str, pipeline: str, machine: MachineProfile) -> str:
        return f"{region_hash}-{pipeline}-{machine.fingerprint()[:16]}"

    def get(self, key: str) -> Decision | None:
        try:
            data = json.loads((self.directory / f"{key}.json").read_text())
            return Decision(bool(data["use_mlir"]), data["mlir_s"], data["inductor_s"], "cache")
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, decision: Decision, machine: MachineProfile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = {
            "use_mlir": decision.use_mlir,
            "mlir_s": decision.mlir_s,
            "inductor_s": decision.inductor_s,
            "machine": machine.describe(),
        }
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(self.directory / f"{key}.json")


def _per_call(fn: Call, budget_s: float) -> float:
    """Seconds per call of ``fn``, batching calls into one sample of about ``budget_s``."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, min(10_000, int(budget_s / once)))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved_timer(
    mlir_call: Call, inductor_call: Call, rounds: int = ROUNDS, sample_s: float = SAMPLE_S
) -> tuple[float, float]:
    """Median per-call seconds of both sides over ``rounds`` interleaved rounds, the order
    alternating each round (so drift in machine load hits both sides alike)."""
    for fn in (mlir_call, inductor_call):  # warm caches and lazy initialisation
        fn()
    mlir, inductor = [], []
    for i in range(rounds):
        if i % 2:
            inductor.append(_per_call(inductor_call, sample_s))
            mlir.append(_per_call(mlir_call, sample_s))
        else:
            mlir.append(_per_call(mlir_call, sample_s))
            inductor.append(_per_call(inductor_call, sample_s))
    return statistics.median(mlir), statistics.median(inductor)


def graph_timer(outlined_call: Call, plain_call: Call) -> tuple[float, float]:
    """:func:`interleaved_timer` sized for whole graphs (:data:`GRAPH_ROUNDS`,
    :data:`GRAPH_SAMPLE_S`)."""
    return interleaved_timer(outlined_call, plain_call, GRAPH_ROUNDS, GRAPH_SAMPLE_S)


_TIMER: list[Timer] = []
_GRAPH_TIMER: list[Timer] = []


@contextlib.contextmanager
def use_timer(timer: Timer) -> Iterator[None]:
    """Decide with ``timer`` inside the block, per region and for whole graphs (tests inject
    fixed times: no test may depend on the speed of the machine it runs on)."""
    _TIMER.append(timer)
    try:
        yield
    finally:
        _TIMER.pop()


@contextlib.contextmanager
def use_graph_timer(timer: Timer) -> Iterator[None]:
    """Decide the whole-graph check with ``timer`` inside the block (over :func:`use_timer`)."""
    _GRAPH_TIMER.append(timer)
    try:
        yield
    finally:
        _GRAPH_TIMER.pop()


def _region_timer() -> Timer:
    return _TIMER[-1] if _TIMER else interleaved_timer


def _whole_graph_timer() -> Timer:
    if _GRAPH_TIMER:
        return _GRAPH_TIMER[-1]
    return _TIMER[-1] if _TIMER else graph_timer


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


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
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


def decide(
    gm: fx.GraphModule,
    run_mlir: Callable[[list[torch.Tensor]], object],
    region_hash: str,
    pipeline: str,
    machine: MachineProfile,
    cache: DecisionCache | None = None,
) -> Decision:
    """Run the region as the MLIR kernel or leave it to Inductor: by ``MFUSION_MLIR_CHOICE``,
    else from the cache, else measured now (and cached).

    Args:
        gm: The region as a stand-alone graph module (placeholders carry fake values).
        run_mlir: Runs the MLIR kernel on the given inputs (outputs preallocated by the caller).
        region_hash: Hash of the region's IR (the cache key with ``pipeline`` and ``machine``).
        pipeline: The lowering pipeline the kernel was built with.
        machine: The profile the decision holds for.
        cache: Where decisions are kept (default: :func:`cache_dir`).
    """
    mode = choice_mode()
    if mode != "measure":
        decision = Decision(mode == "always", None, None, f"MFUSION_MLIR_CHOICE={mode}")
        log.info("region %s: %s", region_hash, decision.describe())
        return decision
    cache = cache if cache is not None else DecisionCache()
    key = DecisionCache.key(region_hash, pipeline, machine)
    cached = cache.get(key)
    if cached is not None:
        log.info("region %s: %s", region_hash, cached.describe())
        return cached
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inputs = example_inputs(gm)
    if has_symbolic_shapes(gm):
        # a dynamic region is timed at its hint sizes against the kernel Inductor generates
        # for the dynamic graph (symbolic sizes), which is what the region would run otherwise
        inductor_call = graph_kernel(_copy(gm), inputs)
    else:
        inductor_call = inductor_kernel(gm, inputs)
    with unset_fake_temporarily():
        mlir_s, inductor_s = _region_timer()(lambda: run_mlir(inputs), inductor_call)
    decision = Decision(mlir_s <= inductor_s, mlir_s, inductor_s, "measured")
    cache.put(key, decision, machine)
    log.info("region %s on %s: %s", region_hash, machine.describe(), decision.describe())
    return decision


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


def decide_graph(
    plain: fx.GraphModule,
    outlined: fx.GraphModule,
    machine: MachineProfile,
    cache: DecisionCache | None = None,
) -> Decision:
    """Keep the outlined regions (``use_mlir``) only if the whole graph runs faster with them.

    Both graphs are compiled by Inductor standalone (mfusion's pass off) and timed on the same
    random inputs; from the cache if this pair of graphs was decided on this machine before.

    Args:
        plain: The graph before outlining (a snapshot; placeholders carry fake values).
        outlined: The same graph with the regions replaced by ``mfusion::mlir_region`` calls.
        machine: The profile the decision holds for.
        cache: Where decisions are kept (default: :func:`cache_dir`).

    Raises:
        RuntimeError: a graph could not be compiled or run (the caller puts the regions back).
    """
    cache = cache if cache is not None else DecisionCache()
    pair = hashlib.sha256((graph_signature(plain) + graph_signature(outlined)).encode())
    key = DecisionCache.key(f"graph-{pair.hexdigest()[:32]}", "whole", machine)
    cached = cache.get(key)
    if cached is not None:
        log.info("graph %s: %s", key, cached.describe())
        return cached
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inputs = example_inputs(plain)
    try:
        plain_call = graph_kernel(plain, inputs)
        outlined_call = graph_kernel(outlined, inputs)
        with unset_fake_temporarily():
            outlined_s, plain_s = _whole_graph_timer()(outlined_call, plain_call)
    except Exception as error:  # Inductor reports failures as many error types
        raise RuntimeError(f"{type(error).__name__}: {error}") from error
    decision = Decision(outlined_s < plain_s, outlined_s, plain_s, "measured")
    cache.put(key, decision, machine)
    log.info("graph %s on %s: %s", key, machine.describe(), decision.describe())
    return decision
