"""The passes' two-way measured choices: a candidate form against Inductor's own, kept only where
it is clearly faster on the machine that compiles.

Shared by the passes whose right answer depends on the CPU (and on what else runs on it) rather
than on a rule: ``linear_kernel`` (MKL or oneDNN for a frozen linear), ``conv_layout``
(channels-last or NCHW), ``attention`` (the flash kernel or two GEMMs) and ``patch_conv``
(im2col + GEMM or oneDNN's convolution). Timing, the on-disk cache keyed by the machine profile
and the switches are ``npu_core.decisions``'; this module adds mfusion's policy (:data:`MIN_GAIN`,
Inductor's form as the fallback), its cache folder (``$MFUSION_CACHE_DIR/<kind>``) and the
sample sizes that suit these calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from mfusion import env
from mfusion.machine import MachineProfile
from npu_core import decisions
from npu_core.timing import Call, interleaved_timer

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
    """``measured``, ``cache``, the policy that forced it (``linear_kernel=onednn``) or why the
    fallback was taken (``NPU_CORE_DECISIONS``)."""
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


def default_timer(calls: Mapping[str, Call]) -> dict[str, float]:
    """npu_core's interleaved timer with this module's sample size, fewer rounds for long calls
    (judged by one call of the last candidate, the baseline)."""
    baseline = list(calls.values())[-1]
    start = time.perf_counter()
    baseline()
    rounds = ROUNDS if time.perf_counter() - start < LARGE_CALL_S else LARGE_ROUNDS
    return interleaved_timer(calls, rounds, SAMPLE_S)


@contextlib.contextmanager
def _real_tensors() -> Iterator[None]:
    """Real tensors and no autograd inside a compile: the candidates run on random inputs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        yield


def decide(
    kind: str,
    fields: dict[str, object],
    machine: MachineProfile,
    labels: tuple[str, str],
    calls: Callable[[], tuple[Call, Call]],
    fallback_chosen: bool = False,
) -> Choice:
    """The cached decision for ``fields`` on ``machine``, else ``calls()`` = (candidate,
    baseline) timed now and decided at :data:`MIN_GAIN`; ``fallback_chosen`` where nothing may be
    timed (``NPU_CORE_DECISIONS``).

    Args:
        kind: The cache folder under ``$MFUSION_CACHE_DIR`` and the timer scope.
        fields: What the decision depends on besides the machine (shapes, dtypes, options).
        machine: The profile the decision holds for.
        labels: (candidate, baseline) names, as reports print them.
        calls: Builds both calls on random inputs (run with fake tensors off, no autograd).
        fallback_chosen: The answer without timing: Inductor's form unless the pass documents a
            rule measured elsewhere.
    """
    candidate, baseline = labels

    def candidates() -> dict[str, Call]:
        with _real_tensors():
            candidate_call, baseline_call = calls()
        return {candidate: candidate_call, baseline: baseline_call}

    decision = decisions.decide(
        kind,
        fields,
        candidates,
        fallback=candidate if fallback_chosen else baseline,
        baseline=baseline,
        min_gain=MIN_GAIN,
        profile=machine.decision_profile(),
        cache=decisions.DecisionCache(env.cache_root()),
        timer=default_timer,
        around=_real_tensors,
    )
    seconds = decision.seconds
    return Choice(
        decision.name == candidate,
        seconds[candidate] if seconds else None,
        seconds[baseline] if seconds else None,
        decision.source,
        candidate,
        baseline,
    )
