"""Decisions taken by measurement on the machine that runs them, and remembered on disk.

Many choices in this workspace have no answer that holds everywhere (bf16 or fp32 GEMMs, a
batched or looped Newton-Schulz, oneDNN or MKL, a flash kernel or two GEMMs): the right one
depends on the CPU, its ISA caps, the thread count, the accelerator and the torch build. So a
decision times its candidates once per (what is decided, machine profile), keeps the winner in a
small JSON file, and reads it back on every later run of the same machine. :func:`decide` is the
one entry point; the timer comes from :mod:`npu_core.timing` (tests inject fake ones), the
profile from :mod:`npu_core.machine`, the switches from :mod:`npu_core.env`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from npu_core import env
from npu_core.device import synchronizer
from npu_core.files import write_text_atomic
from npu_core.machine import machine_profile
from npu_core.timing import Call, Timer, active_timer, interleaved_timer

log = logging.getLogger("npu_core.decisions")

Candidates = Mapping[str, Call] | Callable[[], Mapping[str, Call]]
"""The candidates by name, or a function that builds them (called only when timing is due:
building can cost a compile)."""


class DecisionMode(enum.StrEnum):
    """What ``NPU_CORE_DECISIONS`` allows."""

    MEASURE = "measure"
    """A cached answer, else time the candidates now and cache the winner (the default)."""
    CACHED = "cached"
    """Cached answers only: nothing is timed; a miss takes the fallback."""
    FALLBACK = "fallback"
    """Nothing is timed or read: every decision takes its documented fallback."""


def decision_mode() -> DecisionMode:
    """``NPU_CORE_DECISIONS`` (default ``measure``).

    Raises:
        ValueError: the variable holds something else; names the value and what is allowed.
    """
    value = env.decisions_mode()
    try:
        return DecisionMode(value)
    except ValueError:
        allowed = ", ".join(m.value for m in DecisionMode)
        raise ValueError(f"{env.DECISIONS}={value!r} is not known; use one of: {allowed}") from None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The chosen candidate and the measurement behind it."""

    name: str
    """The winning candidate's name."""
    seconds: Mapping[str, float] | None
    """Seconds per call of each candidate; None where nothing was measured (a fallback)."""
    source: str
    """``measured``, ``cache``, or why the fallback was taken."""

    def describe(self) -> str:
        """One line for logs and reports, e.g. ``batched: loop 2.1 ms, batched 0.4 ms (cache)``."""
        if self.seconds is None:
            return f"{self.name} ({self.source})"
        times = ", ".join(f"{name} {_format_seconds(s)}" for name, s in self.seconds.items())
        return f"{self.name}: {times} ({self.source})"


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def decision_key(fields: Mapping[str, object], profile: Mapping[str, object]) -> str:
    """Hash of what is decided and the machine it is decided for: the cache file's name."""
    text = json.dumps({"fields": fields, "machine": profile}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class DecisionCache:
    """Decisions on disk: ``<directory>/<namespace>/<key>.json``, each written atomically.

    A reader never sees half a file (concurrent ranks and compiles write the same keys); a file
    that does not parse as a decision is ignored with a warning and measured again, which
    replaces it.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else env.decisions_dir()

    def path(self, namespace: str, key: str) -> Path:
        return self.directory / namespace / f"{key}.json"

    def read(self, namespace: str, key: str) -> Decision | None:
        """The cached decision, or None when there is none or it is unreadable."""
        path = self.path(namespace, key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
            name, seconds = data["choice"], data["seconds"]
            if not isinstance(name, str) or not isinstance(seconds, dict):
                raise TypeError("choice must be a string and seconds a table")
            times = {str(k): float(v) for k, v in seconds.items()}
        except (ValueError, KeyError, TypeError) as error:
            warnings.warn(
                f"ignoring the unreadable decision file {path} ({error}); it is measured again "
                "and replaced",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return Decision(name, times, "cache")

    def write(
        self,
        namespace: str,
        key: str,
        decision: Decision,
        fields: Mapping[str, object],
        profile: Mapping[str, object],
    ) -> Path:
        """Store ``decision`` with what it was taken for (for a reader; the key holds it)."""
        record = {
            "choice": decision.name,
            "seconds": dict(decision.seconds or {}),
            "fields": dict(fields),
            "machine": dict(profile),
        }
        text = json.dumps(record, sort_keys=True, indent=1, default=str)
        return write_text_atomic(self.path(namespace, key), text)


_REMEMBERED: dict[tuple[str, str, str], Decision] = {}


def forget() -> None:
    """Drop the decisions this process remembers (not the files): the next :func:`decide`
    reads the disk again. Tests that change the cache under a running process call it."""
    _REMEMBERED.clear()


def pick(seconds: Mapping[str, float], baseline: str | None = None, min_gain: float = 0.0) -> str:
    """The fastest candidate; with a ``baseline``, the fastest other candidate only where it
    takes at most ``1 - min_gain`` of the baseline's time (a tie stays with the baseline's
    rivals at ``min_gain=0``: at least as fast is enough)."""
    if baseline is None:
        return min(seconds, key=lambda name: seconds[name])
    rivals = {name: s for name, s in seconds.items() if name != baseline}
    if not rivals:
        return baseline
    best = min(rivals, key=lambda name: rivals[name])
    return best if rivals[best] <= (1 - min_gain) * seconds[baseline] else baseline


def decide(
    namespace: str,
    fields: Mapping[str, object],
    candidates: Candidates,
    *,
    fallback: str,
    baseline: str | None = None,
    min_gain: float = 0.0,
    device: torch.device | str = "cpu",
    profile: Mapping[str, object] | None = None,
    cache: DecisionCache | None = None,
    timer: Timer | None = None,
    around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Decision:
    """The candidate that runs fastest here for ``fields``: remembered, cached, or timed now.

    Args:
        namespace: What kind of decision (a folder of the cache, a scope for
            :func:`npu_core.timing.use_timer`), e.g. ``"ns-strategy"``.
        fields: What the answer depends on besides the machine (shapes, dtypes, options);
            JSON-serialisable, other values by ``str``.
        candidates: ``{name: call}`` or a function building it.
        fallback: The answer where nothing may be timed (``NPU_CORE_DECISIONS``).
        baseline: The candidate the others must beat by ``min_gain`` (None: the fastest wins).
        min_gain: Fraction of the baseline's time a rival must save.
        device: Where the candidates run: the profile's device and the timer's synchronisation.
        profile: What the decision holds for (default :func:`npu_core.machine.machine_profile`).
        cache: Where decisions are kept (default ``$NPU_CORE_CACHE_DIR``).
        timer: The timer unless a test injected one (default: interleaved rounds).
        around: A context the timing runs in (e.g. fake tensors off inside a compile).

    Raises:
        ValueError: ``NPU_CORE_DECISIONS`` is unknown, or ``fallback`` / ``baseline`` is not a
            candidate.
    """
    mode = decision_mode()
    if mode is DecisionMode.FALLBACK:
        return Decision(fallback, None, f"fallback, {env.DECISIONS}={mode.value}")
    profile = machine_profile(device) if profile is None else profile
    cache = cache if cache is not None else DecisionCache()
    key = decision_key(fields, profile)
    remembered = (str(cache.directory), namespace, key)
    known = _REMEMBERED.get(remembered) or cache.read(namespace, key)
    if known is not None:
        _REMEMBERED[remembered] = known
        return known
    if mode is DecisionMode.CACHED:
        return Decision(fallback, None, f"fallback, not cached and {env.DECISIONS}=cached")
    calls = candidates() if callable(candidates) else candidates
    for role, name in (("fallback", fallback), ("baseline", baseline)):
        if name is not None and name not in calls:
            raise ValueError(f"{role} {name!r} is not one of the candidates {list(calls)}")
    default = timer or functools.partial(interleaved_timer, sync=synchronizer(device))
    with around() if around is not None else contextlib.nullcontext():
        seconds = active_timer(namespace, default)(calls)
    decision = Decision(pick(seconds, baseline, min_gain), dict(seconds), "measured")
    cache.write(namespace, key, decision, fields, profile)
    _REMEMBERED[remembered] = dataclasses.replace(decision, source="cache")
    log.info("%s %s: %s", namespace, json.dumps(fields, default=str), decision.describe())
    return decision
