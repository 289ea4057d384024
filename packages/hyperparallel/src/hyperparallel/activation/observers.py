"""How a checkpointed region tells schedules about itself: two small protocols and the context
holding the active observers.

A leaf module: the region, the swap schedule and the recompute session all import it and none
imports another, so a new schedule (e.g. a pipeline hook) needs nothing from the region's code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable


@dataclass
class RegionStats:
    """Counters a :class:`~hyperparallel.activation.schedule.RecomputeHandle` reads."""

    recomputes: int = 0
    replayed_ops: int = 0


@runtime_checkable
class ObservedRegion(Protocol):
    """What an observer may ask of a region: its name and counters, and three actions."""

    name: str
    stats: RegionStats

    @property
    def swaps_anything(self) -> bool:
        """Whether the region holds (or will hold) host copies: swapped outputs or inputs."""
        ...

    def offload_inputs(self) -> None:
        """Copy the region's inputs to host now (a no-op unless it swaps inputs)."""
        ...

    def prefetch(self) -> None:
        """Start copying back everything the region swapped."""
        ...

    def recompute_now(self) -> None:
        """Replay the region now so that its backward reuses the results."""
        ...


@runtime_checkable
class RegionObserver(Protocol):
    """Told when each region's forward starts and ends, and when backward reaches it.

    ``schedules_offload`` says whether this observer decides when region inputs go to host;
    when no active observer does, a region swapping its inputs offloads them as its forward
    returns.
    """

    @property
    def schedules_offload(self) -> bool:
        """Read-only, so a class constant (``ClassVar[bool]``) satisfies it."""
        ...

    def region_started(self, region: ObservedRegion) -> None:
        """A region's forward begins (regions arrive in forward order)."""
        ...

    def region_finished(self, region: ObservedRegion) -> None:
        """A region's forward has returned."""
        ...

    def wants_backward_hook(self, region: ObservedRegion) -> bool:
        """Whether :meth:`backward_reached` should be called for ``region``."""
        ...

    def backward_reached(self, region: ObservedRegion) -> None:
        """The gradient of one of ``region``'s outputs was computed (its backward is next)."""
        ...


_OBSERVERS: contextvars.ContextVar[tuple[RegionObserver, ...]] = contextvars.ContextVar(
    "hyperparallel_region_observers", default=()
)

ObserverT = TypeVar("ObserverT")


def active_observers() -> tuple[RegionObserver, ...]:
    """The observers regions created in this context notify, outermost first."""
    return _OBSERVERS.get()


def push_observer(observer: RegionObserver) -> contextvars.Token:
    """Make ``observer`` active; an active observer of the same type is hidden until
    :func:`pop_observer` (the innermost schedule of a kind wins, as a nested ``with`` reads).

    Returns:
        The token to give :func:`pop_observer`.
    """
    kept = tuple(o for o in _OBSERVERS.get() if type(o) is not type(observer))
    return _OBSERVERS.set((*kept, observer))


def pop_observer(token: contextvars.Token) -> None:
    """Undo the :func:`push_observer` that returned ``token``."""
    _OBSERVERS.reset(token)


def innermost(kind: type[ObserverT]) -> ObserverT | None:
    """The active observer of class ``kind`` (or a subclass), if any."""
    for observer in reversed(_OBSERVERS.get()):
        if isinstance(observer, kind):
            return observer
    return None


@contextlib.contextmanager
def no_observers() -> Iterator[None]:
    """Run a block that notifies nobody (a region's replay must not register again)."""
    token = _OBSERVERS.set(())
    try:
        yield
    finally:
        _OBSERVERS.reset(token)
