"""Recompute as a task of its own: handles collected in forward, run early, reused by backward.

A :class:`RecomputeSession` collects one :class:`RecomputeHandle` per checkpointed region whose
forward runs inside it, grouped by a key (a micro-batch index). ``handle.recompute()`` replays
the region at any time before its backward, e.g. while another micro-batch's backward or a
pipeline send is in flight; backward then takes the stored tensors (each once, freed as it is
taken) instead of replaying. The session is a region observer
(:mod:`~hyperparallel.activation.observers`); pipeline schedules that use it live in
:mod:`~hyperparallel.activation.pipeline`.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import defaultdict
from collections.abc import Hashable, Iterator
from typing import ClassVar

from hyperparallel.activation.observers import (
    ObservedRegion,
    RegionStats,
    pop_observer,
    push_observer,
)


class RecomputeHandle:
    """The recompute of one region, schedulable on its own.

    Holds the region weakly: once backward has consumed the region, the handle is done and
    holds nothing.
    """

    def __init__(self, region: ObservedRegion) -> None:
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

    schedules_offload: ClassVar[bool] = False
    """A session leaves input offloading to the regions (or to a swap schedule)."""

    def __init__(self) -> None:
        self._handles: dict[Hashable, list[RecomputeHandle]] = defaultdict(list)
        self._key: Hashable = None
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> RecomputeSession:
        self._tokens.append(push_observer(self))
        return self

    def __exit__(self, *exc: object) -> None:
        pop_observer(self._tokens.pop())

    # ---- RegionObserver ----

    def region_started(self, region: ObservedRegion) -> None:
        """Nothing to do before a region's forward."""

    def region_finished(self, region: ObservedRegion) -> None:
        """Collect the region's handle under the current micro-batch."""
        self.add(region)

    def wants_backward_hook(self, region: ObservedRegion) -> bool:
        """A session is told nothing from backward."""
        return False

    def backward_reached(self, region: ObservedRegion) -> None:
        """Unused (see :meth:`wants_backward_hook`)."""

    @contextlib.contextmanager
    def micro_batch(self, key: Hashable) -> Iterator[None]:
        """Regions created in this block belong to ``key``."""
        previous, self._key = self._key, key
        try:
            yield
        finally:
            self._key = previous

    def add(self, region: ObservedRegion) -> RecomputeHandle:
        """Collect ``region``'s handle under the current micro-batch (its forward finished)."""
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
