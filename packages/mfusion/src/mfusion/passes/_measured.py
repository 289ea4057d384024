"""Decisions measured on the machine that compiles: time two forms, keep the candidate only where
it is clearly faster, and remember the answer on disk.

Shared by the passes whose right answer depends on the CPU (and on what else runs on it) rather
than on a rule: ``linear_kernel`` (MKL or oneDNN for a frozen linear) and ``conv_layout``
(channels-last or NCHW convolutions in a graph whose weights are inputs). Each decision is keyed
by what was timed and the machine profile, so a second compile on the same machine measures
nothing and a compile on another machine measures again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mfusion.machine import MachineProfile
from mfusion.mlir.choice import Timer, interleaved_timer
from mfusion.mlir.choice import cache_dir as mlir_cache_dir

MIN_GAIN = 0.03
"""The candidate must take at most ``1 - MIN_GAIN`` of the baseline's time: a tie stays with
Inductor's form."""

ROUNDS = 9
"""Interleaved rounds per decision (odd, so the median is one measured round)."""

SAMPLE_S = 0.005
"""Target length of one sample; the calls timed here take 0.5-60 ms."""

LARGE_CALL_S = 0.05
"""A call slower than this gets :data:`LARGE_ROUNDS` rounds: its timings are long enough to be
steady, and nine rounds of a one-second call would add half a minute to the compile."""

LARGE_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class Choice:
    """Whether the candidate form wins, and the measurement behind it."""

    chosen: bool
    candidate_s: float | None
    baseline_s: float | None
    source: str
    """``measured``, ``cache`` or the policy that forced it (``linear_kernel=onednn``)."""
    candidate: str
    baseline: str

    def describe(self) -> str:
        if self.candidate_s is None or self.baseline_s is None:
            return f"{self.candidate if self.chosen else self.baseline} ({self.source})"
        return (
            f"{self.candidate} {self.candidate_s * 1e6:.0f} us vs "
            f"{self.baseline} {self.baseline_s * 1e6:.0f} us "
            f"(ratio {self.candidate_s / self.baseline_s:.2f}, {self.source})"
        )


_TIMER: list[Timer] = []


@contextlib.contextmanager
def use_timer(timer: Timer) -> Iterator[None]:
    """Decide with ``timer(candidate_call, baseline_call)`` inside the block (tests inject fixed
    times: no test may depend on the speed of the machine it runs on)."""
    _TIMER.append(timer)
    try:
        yield
    finally:
        _TIMER.pop()


def timer() -> Timer:
    """The timer of the innermost :func:`use_timer` block, else :func:`default_timer`."""
    return _TIMER[-1] if _TIMER else default_timer


def default_timer(
    candidate: Callable[[], object], baseline: Callable[[], object]
) -> tuple[float, float]:
    """Median per-call seconds of both in interleaved rounds (the ``mlir-cpu`` choice's timer),
    fewer rounds for long calls."""
    start = time.perf_counter()
    baseline()
    rounds = ROUNDS if time.perf_counter() - start < LARGE_CALL_S else LARGE_ROUNDS
    return interleaved_timer(candidate, baseline, rounds, SAMPLE_S)


def decisions_dir(kind: str) -> Path:
    """``<kind>`` next to the ``mlir-cpu`` decisions (``$MFUSION_CACHE_DIR``, else under
    ``$XDG_CACHE_HOME/mfusion`` or ``~/.cache/mfusion``)."""
    return mlir_cache_dir().parent / kind


def decide(
    kind: str,
    fields: dict[str, object],
    machine: MachineProfile,
    labels: tuple[str, str],
    measure: Callable[[], tuple[float, float]],
) -> Choice:
    """The cached decision for ``fields`` on ``machine``, else ``measure()`` = (candidate
    seconds, baseline seconds), decided at :data:`MIN_GAIN` and written to the cache."""
    key = _cache_key(fields, machine)
    path = decisions_dir(kind) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        times = data["candidate_s"], data["baseline_s"]
        return Choice(bool(data["chosen"]), *times, "cache", *labels)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    candidate_s, baseline_s = measure()
    chosen = candidate_s <= (1 - MIN_GAIN) * baseline_s
    choice = Choice(chosen, candidate_s, baseline_s, "measured", *labels)
    _write(path, {"chosen": chosen, "candidate_s": candidate_s, "baseline_s": baseline_s, **fields})
    return choice


def _cache_key(fields: dict[str, object], machine: MachineProfile) -> str:
    text = json.dumps({**fields, "machine": machine.fingerprint()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _write(path: Path, data: dict[str, object]) -> None:
    """The decision, and what it was taken for (for a reader of the file; the key holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)  # atomic: a concurrent compile never reads half
