"""Recompute as a task of its own: handles collected in forward, run early, reused by backward.

A :class:`RecomputeSession` collects one :class:`RecomputeHandle` per checkpointed region whose
forward runs inside it, grouped by a key (a micro-batch index). ``handle.recompute()`` replays
the region at any time before its backward, e.g. while another micro-batch's backward or a
pipeline send is in flight; backward then takes the stored tensors (each once, freed as it is
taken) instead of replaying. :class:`EarlyRecompute1F1B` does this inside
``torch.distributed.pipelining``'s 1F1B schedule.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import defaultdict
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

from torch.distributed.pipelining import Schedule1F1B

if TYPE_CHECKING:
    from hyperparallel.activation.region import Region, RegionStats


class RecomputeHandle:
    """The recompute of one region, schedulable on its own.

    Holds the region weakly: once backward has consumed the region, the handle is done and
    holds nothing.
    """

    def __init__(self, region: Region) -> None:
        self._region = weakref.ref(region)
        self.name = region.name
        self.stats: RegionStats = region.stats

    def recompute(self) -> None:
        """Replay the region now (once; later calls and backward reuse the result).

        An FSDP2 (``fully_shard``) region first gathers its parameters with ``unshard()``;
        backward then finds them already gathered.
        """
        region = self._region()
        if region is not None:  # None: backward already ran
            region.recompute_now()

    @property
    def done(self) -> bool:
        """Whether backward has finished with the region (its graph is freed)."""
        return self._region() is None

    @property
    def recomputes(self) -> int:
        """How many times the region was replayed (1 in normal use, early or not)."""
        return self.stats.recomputes

    def __repr__(self) -> str:
        return f"RecomputeHandle({self.name!r}, recomputes={self.recomputes}, done={self.done})"


class RecomputeSession:
    """Collects recompute handles of the regions run inside it, keyed by micro-batch.

    Example::

        session = RecomputeSession()
        with session, session.micro_batch(0):
            loss0 = model(x0).sum()
        with session, session.micro_batch(1):
            loss1 = model(x1).sum()
        session.recompute(0)        # e.g. while micro-batch 1's backward communicates
        loss0.backward()            # reuses the early results
    """

    def __init__(self) -> None:
        self._handles: dict[Hashable, list[RecomputeHandle]] = defaultdict(list)
        self._key: Hashable = None
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> RecomputeSession:
        self._tokens.append(_SESSION.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _SESSION.reset(self._tokens.pop())

    @contextlib.contextmanager
    def micro_batch(self, key: Hashable) -> Iterator[None]:
        """Regions created in this block belong to ``key``."""
        previous, self._key = self._key, key
        try:
            yield
        finally:
            self._key = previous

    def add(self, region: Region) -> RecomputeHandle:
        """Called by a region when its forward finishes."""
        handle = RecomputeHandle(region)
        self._handles[self._key].append(handle)
        return handle

    def handles(self, key: Hashable = None) -> list[RecomputeHandle]:
        """Handles of ``key``'s regions, in forward order."""
        return list(self._handles.get(key, ()))

    def recompute(self, key: Hashable = None) -> None:
        """Recompute ``key``'s regions, last first (the order backward needs them)."""
        for handle in reversed(self._handles.get(key, ())):
            handle.recompute()

    def release(self, key: Hashable = None) -> None:
        """Forget ``key``'s handles (after its backward)."""
        self._handles.pop(key, None)


_SESSION: contextvars.ContextVar[RecomputeSession | None] = contextvars.ContextVar(
    "hyperparallel_recompute_session", default=None
)


def current_session() -> RecomputeSession | None:
    """The :class:`RecomputeSession` active in this context, if any."""
    return _SESSION.get()


@contextlib.contextmanager
def no_session() -> Iterator[None]:
    """Run a block outside any session (a region's replay must not register)."""
    token = _SESSION.set(None)
    try:
        yield
    finally:
        _SESSION.reset(token)


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
