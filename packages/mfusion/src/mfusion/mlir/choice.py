"""Measured per-region choice between the MLIR kernel and Inductor's kernel, and the whole-graph
check, both taken through :func:`npu_core.decisions.decide` and cached on disk.

An MLIR kernel is an opaque call Inductor cannot fuse around, and whether it beats Inductor's
own kernel depends on the region (exp-heavy rows: often; erf, short rows: not) and on the
machine. So every region the ``mlir-cpu`` backend compiles is timed against Inductor's kernel
for the same region on the machine it runs on, and outlined only where the MLIR kernel is not
slower; otherwise it stays in the graph for Inductor.

- **What is timed.** The MLIR side is the JIT-compiled kernel writing into preallocated outputs
  (as ``mfusion::mlir_region`` runs it, minus the output allocation). The Inductor side is the
  region's own FX graph compiled by Inductor standalone (:mod:`mfusion.mlir.standalone`), called
  with the same random inputs. A region with symbolic dims (one MLIR kernel for every size) is
  timed at the sizes the compile traced with (the symbols' hints) against Inductor's kernel for
  the region compiled with the same symbolic sizes: the decision taken at that size holds for
  every size the compiled graph later runs.
- **How.** npu_core's interleaved timer (:data:`ROUNDS` rounds of about :data:`SAMPLE_S`
  samples, the order alternating); medians decide, a tie goes to the MLIR kernel.
- **Cache.** One JSON file per (region IR hash, pipeline, machine profile) under
  ``$MFUSION_CACHE_DIR/mlir-choice`` (default ``$XDG_CACHE_HOME/mfusion`` or
  ``~/.cache/mfusion``). A hit costs one file read; a new machine profile (another CPU, ISA
  cap, thread count or torch) measures again.
- **Override.** ``MFUSION_MLIR_CHOICE=measure`` (default), ``always`` (outline every region
  the JIT compiles, used by tests of the outlining itself) or ``never``; with
  ``NPU_CORE_DECISIONS=fallback`` nothing is timed and regions stay with Inductor. Inductor's FX
  graph cache key does not see these variables: use a fresh ``TORCHINDUCTOR_CACHE_DIR`` after
  changing them.

Every decision is logged (logger ``mfusion.mlir``) with both times and where it came from.

**Whole-graph check** (:func:`decide_graph`). A region measured faster alone can still cost the
model time: Inductor had fused it with its neighbours, and the opaque call splits that fusion
(one more pass over memory). So once regions of a graph are outlined, the graph is compiled by
Inductor twice, with and without them, both timed on the same random inputs
(:data:`GRAPH_ROUNDS` interleaved rounds of about :data:`GRAPH_SAMPLE_S`), and the outlined
form is kept only if it is not slower; otherwise every region is put back for Inductor. Cached
under ``mlir-graph`` per (both graphs' structure and shapes, machine profile); tests time it apart
from the regions with ``npu_core.timing.use_timer(timer, GRAPH_NAMESPACE)``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx

from mfusion import env
from mfusion.machine import MachineProfile
from mfusion.mlir import standalone
from npu_core import decisions
from npu_core.timing import interleaved_timer

log = logging.getLogger("mfusion.mlir")

ROUNDS = 7
"""Interleaved rounds per region decision (odd, so the median is one measured round)."""

SAMPLE_S = 0.002
"""Target length of one timed sample (calls are batched up to it); ~ROUNDS x 2 x 2 ms per region."""

GRAPH_ROUNDS = 9
"""Interleaved rounds of the whole-graph check (odd)."""

GRAPH_SAMPLE_S = 0.02
"""Target length of one whole-graph sample: a graph call takes milliseconds, and one call per
sample is at the mercy of every scheduler tick."""

CHOICES = ("measure", "always", "never")

REGION_NAMESPACE = "mlir-choice"
"""The region decisions' folder and timer scope."""

GRAPH_NAMESPACE = "mlir-graph"
"""The whole-graph decisions' folder and timer scope."""


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
    """Where region decisions are kept: ``$MFUSION_CACHE_DIR/mlir-choice``, else under
    ``$XDG_CACHE_HOME/mfusion`` or ``~/.cache/mfusion``."""
    return env.cache_root() / REGION_NAMESPACE


def _as_decision(decision: decisions.Decision, mlir: str, inductor: str) -> Decision:
    """npu_core's record of a two-way choice as this module's view of it."""
    seconds = decision.seconds
    return Decision(
        decision.name == mlir,
        seconds[mlir] if seconds else None,
        seconds[inductor] if seconds else None,
        decision.source,
    )


def decide(
    gm: fx.GraphModule,
    run_mlir: Callable[[list[torch.Tensor]], object],
    region_hash: str,
    pipeline: str,
    machine: MachineProfile,
    cache: decisions.DecisionCache | None = None,
) -> Decision:
    """Run the region as the MLIR kernel or leave it to Inductor: by ``MFUSION_MLIR_CHOICE``,
    else from the cache, else measured now (and cached).

    Args:
        gm: The region as a stand-alone graph module (placeholders carry fake values).
        run_mlir: Runs the MLIR kernel on the given inputs (outputs preallocated by the caller).
        region_hash: Hash of the region's IR (the cache key with ``pipeline`` and ``machine``).
        pipeline: The lowering pipeline the kernel was built with.
        machine: The profile the decision holds for.
        cache: Where decisions are kept (default: ``$MFUSION_CACHE_DIR``).
    """
    mode = choice_mode()
    if mode != "measure":
        decision = Decision(mode == "always", None, None, f"MFUSION_MLIR_CHOICE={mode}")
        log.info("region %s: %s", region_hash, decision.describe())
        return decision
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def candidates() -> dict[str, standalone.Call]:
        inputs = standalone.example_inputs(gm)
        if standalone.has_symbolic_shapes(gm):
            # a dynamic region is timed at its hint sizes against the kernel Inductor generates
            # for the dynamic graph (symbolic sizes), which is what the region would run otherwise
            inductor_call = standalone.graph_kernel(standalone.copy_graph(gm), inputs)
        else:
            inductor_call = standalone.inductor_kernel(gm, inputs)
        return {"mlir": lambda: run_mlir(inputs), "inductor": inductor_call}

    measured = decisions.decide(
        REGION_NAMESPACE,
        {"region": region_hash, "pipeline": pipeline},
        candidates,
        fallback="inductor",
        baseline="inductor",
        profile=machine.decision_profile(),
        cache=cache if cache is not None else decisions.DecisionCache(env.cache_root()),
        timer=functools.partial(interleaved_timer, rounds=ROUNDS, sample_s=SAMPLE_S),
        around=unset_fake_temporarily,
    )
    decision = _as_decision(measured, "mlir", "inductor")
    log.info("region %s on %s: %s", region_hash, machine.describe(), decision.describe())
    return decision


def decide_graph(
    plain: fx.GraphModule,
    outlined: fx.GraphModule,
    machine: MachineProfile,
    cache: decisions.DecisionCache | None = None,
) -> Decision:
    """Keep the outlined regions (``use_mlir``) only if the whole graph runs no slower with them.

    Both graphs are compiled by Inductor standalone (mfusion's pass off) and timed on the same
    random inputs; from the cache if this pair of graphs was decided on this machine before.

    Args:
        plain: The graph before outlining (a snapshot; placeholders carry fake values).
        outlined: The same graph with the regions replaced by ``mfusion::mlir_region`` calls.
        machine: The profile the decision holds for.
        cache: Where decisions are kept (default: ``$MFUSION_CACHE_DIR``).

    Raises:
        RuntimeError: a graph could not be compiled or run (the caller puts the regions back).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def candidates() -> dict[str, standalone.Call]:
        inputs = standalone.example_inputs(plain)
        plain_call = standalone.graph_kernel(plain, inputs)
        return {"outlined": standalone.graph_kernel(outlined, inputs), "plain": plain_call}

    fields = {
        "plain": standalone.graph_signature(plain),
        "outlined": standalone.graph_signature(outlined),
    }
    try:
        measured = decisions.decide(
            GRAPH_NAMESPACE,
            fields,
            candidates,
            fallback="plain",
            baseline="plain",
            profile=machine.decision_profile(),
            cache=cache if cache is not None else decisions.DecisionCache(env.cache_root()),
            timer=functools.partial(
                interleaved_timer, rounds=GRAPH_ROUNDS, sample_s=GRAPH_SAMPLE_S
            ),
            around=unset_fake_temporarily,
        )
    except Exception as error:  # Inductor reports failures as many error types
        raise RuntimeError(f"{type(error).__name__}: {error}") from error
    decision = _as_decision(measured, "outlined", "plain")
    log.info("graph on %s: %s", machine.describe(), decision.describe())
    return decision
