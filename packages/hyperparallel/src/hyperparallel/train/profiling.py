"""Chrome traces of chosen training steps (``--profile-steps``), one file per rank and step.

The trainer wraps each step's work in :meth:`StepProfiler.step`; for the chosen steps that runs
``torch.profiler`` around it and writes ``OUT_DIR/profile/rank{R}_step{S}.json`` (open it in
Perfetto or ``chrome://tracing``). Other steps run without a profiler, so a run that profiles
step 3 pays nothing at the other steps. One profiler per chosen step (rather than one
``torch.profiler.schedule`` over the run) keeps each file to exactly one step, numbered as in
``metrics.json`` (1-based).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_profile_steps(spec: str) -> frozenset[int]:
    """Step numbers (1-based, as in ``metrics.json``) named by ``spec``.

    ``spec`` is empty (profile nothing) or comma-separated items, each a step (``3``) or an
    inclusive range (``3-5``, a count of consecutive steps): ``"3,4"``, ``"3-6"``, ``"2,5-6"``.

    Raises:
        ValueError: an item that is not a positive step or range, or a range that runs
            backwards; the message quotes the item and the grammar.
    """
    steps: set[int] = set()
    if not spec.strip():
        return frozenset()
    for item in spec.split(","):
        match = _ITEM.match(item.strip())
        first = int(match.group(1)) if match else 0
        last = int(match.group(2) or first) if match else 0
        if match is None or first < 1 or last < first:
            raise ValueError(
                f"profile_steps={spec!r}: {item.strip()!r} is not a step or range; use steps "
                "from 1 and inclusive ranges, e.g. '3,4' or '3-6'"
            )
        steps.update(range(first, last + 1))
    return frozenset(steps)


class StepProfiler:
    """Profiles the chosen steps of one rank and writes a Chrome trace for each.

    Args:
        steps: step numbers (1-based) to profile, or a ``--profile-steps`` string for
            :func:`parse_profile_steps`.
        out_dir: the run's output folder; traces go to ``out_dir/profile/``.
        rank: this rank's global rank (part of each file name).
        device: the training device; CUDA kernels are recorded on a CUDA device, CPU ops
            always.

    Attributes:
        written: the trace files written so far, in order.
    """

    def __init__(
        self,
        steps: Iterable[int] | str,
        out_dir: str | Path,
        rank: int,
        device: torch.device | None = None,
    ) -> None:
        self.steps = parse_profile_steps(steps) if isinstance(steps, str) else frozenset(steps)
        if any(step < 1 for step in self.steps):
            raise ValueError(f"steps={sorted(self.steps)}: step numbers start at 1")
        self.folder = Path(out_dir) / "profile"
        self.rank = rank
        self.activities = [ProfilerActivity.CPU]
        if device is not None and device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.written: list[Path] = []

    def path(self, step: int) -> Path:
        """Where the trace of ``step`` (1-based) goes."""
        return self.folder / f"rank{self.rank}_step{step}.json"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run the body under ``torch.profiler`` when ``step`` (1-based) was chosen and write its
        trace on exit; otherwise do nothing. A step that raises writes no trace."""
        if step not in self.steps:
            yield
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        marker = f"train_step_{step}"
        with profile(activities=self.activities) as prof, torch.profiler.record_function(marker):
            yield
        target = self.path(step)
        partial = target.with_suffix(".json.tmp")
        prof.export_chrome_trace(str(partial))
        partial.replace(target)  # a reader never sees a half-written trace
        self.written.append(target)
