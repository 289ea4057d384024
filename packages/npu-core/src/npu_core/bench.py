"""Benchmark helpers shared by every package's benchmarks: timing, A/B comparison, result tables.

Accelerator work is asynchronous, so timings synchronise the device before reading the clock;
otherwise they measure how fast kernels are queued, not how fast they run. Results are written
as JSON (for tooling) and Markdown (for humans) with an environment block that identifies the
software and hardware but never the machine (no hostnames, no paths).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from npu_core import env
from npu_core.capability import fast_matmul
from npu_core.device import detect_backend, device_module
from npu_core.files import write_text_atomic
from npu_core.machine import cpu_info


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock samples of repeated calls, in seconds, with order statistics.

    The median and interquartile range are the numbers to report: unlike mean and stdev they
    are not dragged by the occasional sample hit by a GC pause or a noisy neighbour.
    """

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        # Accept any sequence but store a tuple, so a Timing cannot change after the fact.
        object.__setattr__(self, "samples", tuple(self.samples))
        if not self.samples:
            raise ValueError("Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def stdev(self) -> float:
        """Sample standard deviation; 0.0 for a single sample."""
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def _quartiles(self) -> tuple[float, float]:
        if len(self.samples) == 1:
            return self.samples[0], self.samples[0]
        p25, _, p75 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return p25, p75

    @property
    def p25(self) -> float:
        return self._quartiles()[0]

    @property
    def p75(self) -> float:
        return self._quartiles()[1]

    @property
    def iqr(self) -> float:
        p25, p75 = self._quartiles()
        return p75 - p25

    def to_dict(self) -> dict[str, Any]:
        """Statistics and raw samples, in seconds, ready for JSON."""
        names = ("median", "mean", "stdev", "min", "max", "p25", "p75", "iqr")
        return {name: getattr(self, name) for name in names} | {"samples": list(self.samples)}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Timings of a baseline and a candidate measured in interleaved rounds."""

    baseline: Timing
    candidate: Timing
    ratios: tuple[float, ...]
    """Per-round baseline time / candidate time."""

    @property
    def speedup(self) -> float:
        """median(baseline) / median(candidate); above 1 means the candidate is faster."""
        return _ratio(self.baseline.median, self.candidate.median)

    @property
    def ratio_median(self) -> float:
        """Median of per-round ratios: robust to drift, since both sides of a round share it."""
        return statistics.median(self.ratios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.to_dict(),
            "candidate": self.candidate.to_dict(),
            "speedup": self.speedup,
            "ratio_median": self.ratio_median,
        }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def default_sync() -> Callable[[], None]:
    """A function that waits for the detected accelerator to finish its work (no-op on cpu)."""
    module = device_module(detect_backend())
    if module is None:
        return lambda: None
    sync: Callable[[], None] = module.synchronize
    return sync


def _check_counts(warmup: int, repeats: int, calls: int = 1) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")


def _run(fn: Callable[[], object], calls: int) -> None:
    for _ in range(calls):
        fn()


def _time_call(fn: Callable[[], object], sync: Callable[[], None], calls: int = 1) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``."""
    # Sync first too, so work queued before this call is not billed to it.
    sync()
    start = time.perf_counter()
    _run(fn, calls)
    sync()
    return (time.perf_counter() - start) / calls


@contextlib.contextmanager
def _collector_paused(pause: bool) -> Iterator[None]:
    """Collect once, then keep the cyclic garbage collector off (and restore its state)."""
    was_enabled = gc.isenabled()
    if pause:
        gc.collect()
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int = 10,
    sync: Callable[[], None] | None = None,
    calls: int = 1,
) -> Timing:
    """Time ``repeats`` samples of ``fn`` after ``warmup`` untimed ones (caches, compilation).

    ``sync`` runs before each clock read; by default it synchronises the detected accelerator.
    Each sample times ``calls`` back-to-back calls and records the time per call: a function of
    a few milliseconds timed once per sample is at the mercy of every scheduler tick
    (:func:`calls_per_sample` sizes the batch). Warm-up samples are batches too.
    """
    _check_counts(warmup, repeats, calls)
    sync = sync if sync is not None else default_sync()
    for _ in range(warmup):
        _run(fn, calls)
    sync()
    return Timing(tuple(_time_call(fn, sync, calls) for _ in range(repeats)))


def compare(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int = 10,
    sync: Callable[[], None] | None = None,
    calls: int = 1,
    pause_gc: bool = False,
) -> Comparison:
    """Time ``baseline`` against ``candidate`` in ``repeats`` interleaved rounds.

    Rounds alternate the order (A B, B A, ...) so clock-frequency drift, thermal throttling and
    cache state affect both sides equally instead of biasing whichever always runs second.
    ``calls`` batches each sample as in :func:`measure` (times are per call); ``pause_gc``
    collects once and keeps the garbage collector off for the whole comparison, so a
    collection triggered by one side's allocations is not billed to whichever runs next.
    """
    _check_counts(warmup, repeats, calls)
    sync = sync if sync is not None else default_sync()
    with _collector_paused(pause_gc):
        for _ in range(warmup):
            _run(baseline, calls)
            _run(candidate, calls)
        sync()
        base_samples: list[float] = []
        cand_samples: list[float] = []
        for round_index in range(repeats):
            if round_index % 2 == 0:
                base_samples.append(_time_call(baseline, sync, calls))
                cand_samples.append(_time_call(candidate, sync, calls))
            else:
                cand_samples.append(_time_call(candidate, sync, calls))
                base_samples.append(_time_call(baseline, sync, calls))
    ratios = tuple(_ratio(b, c) for b, c in zip(base_samples, cand_samples, strict=True))
    return Comparison(Timing(tuple(base_samples)), Timing(tuple(cand_samples)), ratios)


def calls_per_sample(
    fn: Callable[[], object],
    sample_ms: float,
    *,
    warmup: int = 2,
    repeats: int = 5,
    sync: Callable[[], None] | None = None,
) -> int:
    """How many calls of ``fn`` fill about ``sample_ms`` milliseconds (the ``calls`` to use).

    Measured: the median of ``repeats`` single calls after ``warmup``; at least 1.
    """
    if not sample_ms > 0:
        raise ValueError(f"sample_ms must be a positive number of milliseconds, got {sample_ms}")
    probe = measure(fn, warmup=warmup, repeats=repeats, sync=sync)
    # a call faster than the clock's resolution reads 0 s: then as many as a nanosecond allows
    return max(1, round(sample_ms * 1e-3 / max(probe.median, 1e-9)))


def environment_info() -> dict[str, Any]:
    """Software and hardware that produced a result; nothing that identifies the machine.

    The CPU fields matter even for accelerator runs: the same benchmark on an AVX-512 CPU with
    native bf16 and on an AVX2-only one (bf16 emulated, ~75x slower GEMMs) gives different tables,
    and a table that does not say which it came from cannot be compared with anything.
    """
    backend = detect_backend()
    cpu = cpu_info()
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "backend": backend.value,
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu.model,
        "cpu_capability": cpu.isa,
        "cpu_native_bf16": cpu.native_bf16,
        "cpu_amx": cpu.amx,
        # The flags are a claim; this is what a bf16 GEMM really does here (an ISA cap on
        # oneDNN keeps the flag but emulates bf16).
        "cpu_bf16_gemm_fast": fast_matmul("cpu", torch.bfloat16),
        "threads": torch.get_num_threads(),
    }
    caps = {name: env.read(name) for name in (env.ATEN_CPU_CAPABILITY, env.ONEDNN_MAX_CPU_ISA)}
    info["isa_caps"] = {name: value for name, value in caps.items() if value is not None}
    module = device_module(backend)
    if module is not None:
        info["device_count"] = module.device_count()
        info["device_name"] = module.get_device_name(module.current_device())
    return info


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One Markdown line naming the machine of :func:`environment_info`, for under a table."""
    info = environment_info() if info is None else info
    cpu = f"{info['cpu_model']} ({info['cpu_capability']}"
    if info.get("cpu_bf16_gemm_fast"):
        cpu += ", native bf16 GEMMs"
    elif info.get("cpu_native_bf16"):
        cpu += ", bf16 flag but bf16 GEMMs emulated"
    else:
        cpu += ", bf16 GEMMs emulated"
    cpu += ", AMX)" if info.get("cpu_amx") else ")"
    parts = [f"{info['backend']}", cpu, f"{info['cpu_count']} cores", f"{info['threads']} threads"]
    if info.get("isa_caps"):
        parts.append(" ".join(f"{k}={v}" for k, v in info["isa_caps"].items()))
    if "device_name" in info:
        parts.append(f"{info['device_count']} x {info['device_name']}")
    parts.append(f"torch {info['torch']}")
    return "Machine: " + "; ".join(parts)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that is running, as a user would retype it from the same folder.

    The script path is kept as given (relative when the caller ran it so), never resolved, so
    the line names no folder of the machine that ran it.
    """
    argv = list(sys.argv if argv is None else argv)
    return "python " + shlex.join(argv)


def render_result(data: dict[str, Any]) -> str:
    """Markdown for a result written by :meth:`BenchTable.write`: its table, then the command
    and the machine it came from (read from the file, not from the machine rendering it)."""
    table = BenchTable(data["title"], data["columns"], data.get("metadata"))
    table.rows = [dict(row) for row in data["rows"]]
    lines = table.to_markdown(machine=machine_line(data["environment"])).rstrip("\n").split("\n")
    if data.get("command"):
        lines.insert(-1, f"Command: `{data['command']}`")
        lines.insert(-1, "")
    return "\n".join(lines) + "\n"


def _format_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return f"{value:g}"
        # Three significant digits, without switching to exponents for ordinary magnitudes.
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


class BenchTable:
    """Rows of benchmark results with a title and a fixed column order."""

    def __init__(
        self, title: str, columns: Sequence[str], metadata: dict[str, Any] | None = None
    ) -> None:
        if not columns:
            raise ValueError("BenchTable needs at least one column")
        self.title = title
        self.columns = list(columns)
        self.metadata = dict(metadata or {})
        self.rows: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        """Append a row; missing columns stay empty, unknown ones are an error (likely a typo)."""
        unknown = sorted(set(row) - set(self.columns))
        if unknown:
            raise ValueError(f"unknown columns {unknown}; table columns are {self.columns}")
        self.rows.append(dict(row))

    def to_markdown(self, machine: str | None = None) -> str:
        """A GitHub-flavoured Markdown table under a heading, numeric columns right-aligned,
        followed by the machine line (this machine's unless ``machine`` names another)."""
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |"]
        align = []
        for column in self.columns:
            values = [row[column] for row in self.rows if row.get(column) is not None]
            numeric = bool(values) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in values
            )
            align.append("---:" if numeric else "---")
        lines.append("| " + " | ".join(align) + " |")
        for row in self.rows:
            lines.append("| " + " | ".join(_format_cell(row.get(c)) for c in self.columns) + " |")
        lines += ["", machine_line() if machine is None else machine]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        """Title, the command that ran, metadata (e.g. the benchmark's settings), columns, rows,
        environment."""
        return {
            "title": self.title,
            "command": command_line(),
            "metadata": self.metadata,
            "columns": list(self.columns),
            "rows": [{c: row.get(c) for c in self.columns} for row in self.rows],
            "environment": environment_info(),
        }

    def write(self, out_dir: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
        """Write ``<name>.json`` and ``<name>.md`` into ``out_dir``; return their paths.

        Each file is written to a temporary file in the same directory and renamed into place,
        so a reader (or a crashed run) never sees half a result.
        """
        if not name or Path(name).name != name:
            raise ValueError(f"name must be a plain file name, got {name!r}")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # default=str keeps dtypes, enums and the like readable instead of failing the dump.
        json_text = json.dumps(self.to_json(), indent=2, default=str) + "\n"
        json_path = write_text_atomic(out / f"{name}.json", json_text)
        md_path = write_text_atomic(out / f"{name}.md", self.to_markdown())
        return json_path, md_path
