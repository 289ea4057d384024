"""Recompute scheduled inside ``torch.distributed.pipelining`` schedules: a micro-batch's
checkpointed regions are replayed at a chosen point of the schedule instead of inside its
backward.

- :class:`EarlyRecompute1F1B`: plain 1F1B, recompute just before the gradient receive.
- :class:`PairedRecompute`: for schedules that pair one micro-batch's backward with another's
  forward (``OVERLAP_F_B`` actions of torch's ``_PipelineScheduleRuntime``, e.g.
  ``ScheduleDualPipeV``): the backward micro-batch's recompute is issued right before the
  paired forward starts, as the MindSpore release's overlap_b_f schedule does, so that on an
  accelerator the forward's communication (PP send/recv, EP all-to-all) can hide behind it.
  :class:`EarlyRecomputeDualPipeV` is ``ScheduleDualPipeV`` with it built in.

Each early recompute is a ``PP:recompute {stage}B{micro-batch}`` range for ``torch.profiler``,
next to torch's own ``PP:{action}`` ranges, so a step's trace shows where it ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
)
from torch.profiler import record_function

from hyperparallel.activation.schedule import RecomputeHandle, RecomputeSession

Event = tuple[Literal["F", "R", "B", "I", "W"], int, int]
"""(what, stage index, micro-batch): F forward, R early recompute, B full backward, I input
backward, W weight backward."""


class EarlyRecompute1F1B(Schedule1F1B):
    """``Schedule1F1B`` that recomputes micro-batch ``i``'s checkpointed regions right before
    the communication that precedes its backward, instead of inside the backward.

    Every micro-batch's forward runs inside this schedule's :class:`RecomputeSession`; when the
    1F1B loop asks the stage for micro-batch ``i``'s gradient receives, its recompute runs, so on
    an accelerator it overlaps the peer's send of that gradient; backward then reuses it.
    Arguments are those of ``Schedule1F1B``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.session = RecomputeSession()
        self.early_recomputes: list[int] = []
        """Micro-batches recomputed ahead of their backward, in schedule order."""
        self.recomputed_handles: list[RecomputeHandle] = []
        """Their handles (for inspection: each should show one recompute and be done)."""

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage
        forward, recv, backward = (
            stage.forward_one_chunk,
            stage.get_bwd_recv_ops,
            stage.backward_one_chunk,
        )
        session = self.session

        def forward_one_chunk(fwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            with session, session.micro_batch(fwd_chunk_id):
                return forward(fwd_chunk_id, *a, **kw)

        def get_bwd_recv_ops(bwd_chunk_id: int) -> Any:
            ops = recv(bwd_chunk_id)
            if handles := session.handles(bwd_chunk_id):
                with record_function(f"PP:recompute {stage.stage_index}B{bwd_chunk_id}"):
                    session.recompute(bwd_chunk_id)
                self.early_recomputes.append(bwd_chunk_id)
                self.recomputed_handles.extend(handles)
            return ops

        def backward_one_chunk(bwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            try:
                return backward(bwd_chunk_id, *a, **kw)
            finally:
                session.release(bwd_chunk_id)

        # Instance attributes shadow the stage's methods for this step only.
        patched = {
            "forward_one_chunk": forward_one_chunk,
            "get_bwd_recv_ops": get_bwd_recv_ops,
            "backward_one_chunk": backward_one_chunk,
        }
        for name, fn in patched.items():
            setattr(stage, name, fn)
        try:
            return super()._step_microbatches(*args, **kwargs)
        finally:
            for name in patched:
                delattr(stage, name)


class PairedRecompute:
    """Early recompute for a pipeline schedule whose ``OVERLAP_F_B`` actions pair the forward of
    one micro-batch with the backward of another.

    Works with any ``torch.distributed.pipelining`` runtime schedule (``ScheduleDualPipeV``, or a
    custom ``_PipelineScheduleRuntime`` whose compute order holds ``OVERLAP_F_B`` actions). While
    installed (:meth:`installed`, or :meth:`step`), every local stage's forward runs inside
    :attr:`session`, keyed ``(stage_index, micro_batch)``; when the schedule starts the forward
    half of a pair, the backward half's checkpointed regions are recomputed first, and that
    backward then reuses the results (nothing is replayed twice). Micro-batches not in a pair
    recompute inside their backward as usual. Handles are released after each micro-batch's
    full (or weight) backward.

    Args:
        schedule: the pipeline schedule; its stages' modules hold the checkpointed regions
            (``checkpoint_wrapper``).

    Attributes:
        session: the :class:`RecomputeSession` collecting the regions.
        pairs: ``(forward stage, forward mb) -> (backward stage, backward mb)`` for this rank.
        events: what ran on this rank in order (see :data:`Event`); cleared at each step.
        early_recomputes: ``(stage, mb)`` recomputed ahead of their backward, in order.
        recomputed_handles: their handles (each should show one recompute and be done once
            the step is over).
    """

    def __init__(self, schedule: Any) -> None:
        order = getattr(schedule, "pipeline_order", None)
        if order is None or getattr(schedule, "rank", None) is None:
            raise TypeError(
                f"PairedRecompute needs a torch.distributed.pipelining runtime schedule with a "
                f"pipeline_order (e.g. ScheduleDualPipeV), got {type(schedule).__name__}; for "
                "Schedule1F1B use EarlyRecompute1F1B"
            )
        self.schedule = schedule
        self.session = RecomputeSession()
        self.pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for action in order[schedule.rank]:
            if action is None or action.computation_type != OVERLAP_F_B:
                continue
            subs = action.sub_actions or ()
            forward = [a for a in subs if a.computation_type == FORWARD]
            backward = [a for a in subs if a.computation_type in (FULL_BACKWARD, BACKWARD_INPUT)]
            if len(forward) == 1 and len(backward) == 1:
                f, b = forward[0], backward[0]
                self.pairs[(f.stage_index, f.microbatch_index)] = (
                    b.stage_index,
                    b.microbatch_index,
                )
        self.events: list[Event] = []
        self.early_recomputes: list[tuple[int, int]] = []
        self.recomputed_handles: list[RecomputeHandle] = []

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``schedule.step(*args, **kwargs)`` with the early recompute installed."""
        with self.installed():
            return self.schedule.step(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap the local stages' forward and backward calls for the duration of the block."""
        self.events.clear()
        self.early_recomputes.clear()
        self.recomputed_handles.clear()
        stages = list(getattr(self.schedule, "_stages", None) or [self.schedule._stage])
        names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        for stage in stages:
            self._wrap(stage)
        try:
            yield
        finally:
            for stage in stages:
                for name in names:
                    stage.__dict__.pop(name, None)

    def _wrap(self, stage: Any) -> None:
        index = stage.stage_index
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        backward_weight = stage.backward_weight_one_chunk
        session, events = self.session, self.events

        def forward_one_chunk(fwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            pair = self.pairs.get((index, fwd_chunk_id))
            if pair is not None and (handles := session.handles(pair)):
                with record_function(f"PP:recompute {pair[0]}B{pair[1]}"):
                    session.recompute(pair)  # before the paired forward starts
                events.append(("R", *pair))
                self.early_recomputes.append(pair)
                self.recomputed_handles.extend(handles)
            events.append(("F", index, fwd_chunk_id))
            with session, session.micro_batch((index, fwd_chunk_id)):
                return forward(fwd_chunk_id, *a, **kw)

        def backward_one_chunk(bwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            full = kw.get("full_backward", a[1] if len(a) > 1 else True)
            events.append(("B" if full else "I", index, bwd_chunk_id))
            try:
                return backward(bwd_chunk_id, *a, **kw)
            finally:
                if full:
                    session.release((index, bwd_chunk_id))

        def backward_weight_one_chunk(bwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            events.append(("W", index, bwd_chunk_id))
            try:
                return backward_weight(bwd_chunk_id, *a, **kw)
            finally:
                session.release((index, bwd_chunk_id))

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk


class EarlyRecomputeDualPipeV(ScheduleDualPipeV):
    """``ScheduleDualPipeV`` whose paired forward/backward actions recompute the backward
    micro-batch right before the forward starts (see :class:`PairedRecompute`).

    Arguments are those of ``ScheduleDualPipeV`` (two stages per rank, V layout).

    Attributes:
        recompute: the :class:`PairedRecompute` (``.events``, ``.early_recomputes``,
            ``.session``) of this rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recompute = PairedRecompute(self)

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
        with self.recompute.installed():
            return super()._step_microbatches(*args, **kwargs)
