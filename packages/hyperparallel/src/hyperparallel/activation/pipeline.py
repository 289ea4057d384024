"""Recompute scheduled inside ``torch.distributed.pipelining`` schedules: a micro-batch's
checkpointed regions are replayed at a chosen point of the schedule instead of inside its
backward."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import Schedule1F1B

from hyperparallel.activation.schedule import RecomputeHandle, RecomputeSession


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
                session.recompute(bwd_chunk_id)
                self.early_recomputes.append(bwd_chunk_id)
                self.recomputed_handles.extend(handles)
            return ops

        def backward_one_chunk(bwd_chunk_id: int, *a: Any, **kw: Any) -> Any:
            try:
                return backward(bwd_chunk_id, *a, **kw)
            finally:
                session.release(bwd_chunk_id)

        stage.forward_one_chunk = forward_one_chunk
        stage.get_bwd_recv_ops = get_bwd_recv_ops
        stage.backward_one_chunk = backward_one_chunk
        try:
            return super()._step_microbatches(*args, **kwargs)
        finally:
            for name in ("forward_one_chunk", "get_bwd_recv_ops", "backward_one_chunk"):
                delattr(stage, name)
