"""How measured decisions time their candidates, and the hook through which tests replace that.

A decision compares a few ways of doing the same work on the machine that will run it. Machines
are noisy (a neighbour's job, a frequency change), so the candidates run in interleaved rounds,
the order rotating each round, and each candidate's median per-call time decides: a burst of
load hits every candidate of a round alike. Tests must not depend on the speed of the machine
they run on, so every decision asks :func:`active_timer` for its timer, and :func:`use_timer`
installs a fake one for the length of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping

Call = Callable[[], object]
"""One candidate, bound to its inputs: calling it does the work once."""

Timer = Callable[[Mapping[str, Call]], dict[str, float]]
"""``timer({name: call}) -> {name: seconds per call}``, one entry per candidate."""

ROUNDS = 7
"""Interleaved rounds per decision (odd, so the median is one measured round)."""

SAMPLE_S = 0.002
"""Target length of one timed sample: short calls are batched up to it."""

MAX_CALLS_PER_SAMPLE = 10_000


def _no_sync() -> None:
    """The CPU runs work synchronously: nothing to wait for."""


def per_call_seconds(fn: Call, sample_s: float, sync: Callable[[], None] = _no_sync) -> float:
    """Seconds per call of ``fn`` in one sample of about ``sample_s``.

    One call is timed first; where it already lasts ``sample_s`` it is the sample (a slow
    candidate is not run twice), otherwise as many calls as fill ``sample_s`` are timed together,
    so a microsecond kernel is not measured at the clock's resolution.
    """
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - start
    if once >= sample_s:
        return once
    calls = max(1, min(MAX_CALLS_PER_SAMPLE, int(sample_s / max(once, 1e-7))))
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def interleaved_timer(
    calls: Mapping[str, Call],
    rounds: int = ROUNDS,
    sample_s: float = SAMPLE_S,
    sync: Callable[[], None] = _no_sync,
) -> dict[str, float]:
    """Median per-call seconds of each candidate over ``rounds`` interleaved rounds.

    Every candidate runs once untimed first (lazy initialisation, kernel selection, caches).
    Round ``i`` starts with candidate ``i mod n``, so no candidate always runs first.

    Args:
        calls: The candidates by name (at least one).
        rounds: Rounds of one sample per candidate.
        sample_s: Target length of one sample (:func:`per_call_seconds`).
        sync: Waits for the device's queued work (``npu_core.device.synchronizer``).
    """
    if not calls or rounds < 1:
        raise ValueError(f"need at least one candidate and one round, got {len(calls)}, {rounds}")
    names = list(calls)
    for name in names:
        calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(per_call_seconds(calls[name], sample_s, sync))
    return {name: statistics.median(times) for name, times in samples.items()}


_INJECTED: list[tuple[Timer, str | None]] = []


@contextlib.contextmanager
def use_timer(timer: Timer, namespace: str | None = None) -> Iterator[None]:
    """Time every decision (or only those of ``namespace``) with ``timer`` inside the block.

    Tests inject fixed times this way, so no outcome depends on the machine running them; the
    innermost block that covers a decision's namespace wins.
    """
    _INJECTED.append((timer, namespace))
    try:
        yield
    finally:
        _INJECTED.pop()


def active_timer(namespace: str, default: Timer) -> Timer:
    """The timer of the innermost :func:`use_timer` block covering ``namespace``, else
    ``default``."""
    for timer, scope in reversed(_INJECTED):
        if scope is None or scope == namespace:
            return timer
    return default
