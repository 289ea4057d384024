"""npu_core.bench: timing statistics, interleaved comparison and result tables."""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import pytest
import torch

from npu_core import bench

SAMPLES = (0.5, 0.1, 0.3, 0.9, 0.2, 0.4, 0.7)


def test_timing_statistics_match_statistics_module():
    """Every statistic agrees with the standard library on known samples."""
    timing = bench.Timing(SAMPLES)
    q1, _, q3 = statistics.quantiles(SAMPLES, n=4, method="inclusive")
    assert timing.median == statistics.median(SAMPLES) == 0.4
    assert timing.mean == pytest.approx(statistics.mean(SAMPLES))
    assert timing.stdev == pytest.approx(statistics.stdev(SAMPLES))
    assert (timing.min, timing.max) == (0.1, 0.9)
    assert (timing.p25, timing.p75) == pytest.approx((q1, q3))
    assert timing.iqr == pytest.approx(q3 - q1)
    as_dict = timing.to_dict()
    assert as_dict["samples"] == list(SAMPLES)
    assert as_dict["median"] == 0.4


def test_timing_single_sample_and_empty():
    """One sample has zero spread; no samples is an error."""
    single = bench.Timing((0.25,))
    assert (single.stdev, single.iqr, single.p25, single.p75) == (0.0, 0.0, 0.25, 0.25)
    with pytest.raises(ValueError, match="at least one sample"):
        bench.Timing(())


def test_measure_counts_calls_and_syncs():
    """warmup + repeats calls; sync runs around every timed call; samples cover the work."""
    calls: list[str] = []

    def fn() -> None:
        calls.append("fn")
        time.sleep(0.002)

    timing = bench.measure(fn, warmup=3, repeats=4, sync=lambda: calls.append("sync"))
    assert calls.count("fn") == 7
    assert len(timing.samples) == 4
    assert calls.count("sync") >= 2 * 4
    assert calls[-1] == "sync"  # the clock is read only after the last sync
    assert timing.min >= 0.0015


@pytest.mark.parametrize("func", [bench.measure, lambda fn, **kw: bench.compare(fn, fn, **kw)])
def test_bad_counts_name_the_argument(func):
    """repeats < 1 and warmup < 0 raise ValueError naming the argument and its value."""
    with pytest.raises(ValueError, match=r"repeats must be >= 1, got 0"):
        func(lambda: None, repeats=0)
    with pytest.raises(ValueError, match=r"warmup must be >= 0, got -1"):
        func(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match=r"calls must be >= 1, got 0"):
        func(lambda: None, calls=0)


def test_compare_interleaves_and_reports_speedup():
    """A 6 ms baseline vs a 2 ms candidate is about 3x faster, by both estimators."""
    order: list[str] = []

    def slow() -> None:
        order.append("A")
        time.sleep(0.006)

    def fast() -> None:
        order.append("B")
        time.sleep(0.002)

    result = bench.compare(slow, fast, warmup=1, repeats=6, sync=lambda: None)
    assert order == ["A", "B"] + ["A", "B", "B", "A"] * 3
    assert len(result.baseline.samples) == len(result.candidate.samples) == len(result.ratios) == 6
    assert 1.5 < result.speedup < 4.0
    assert 1.5 < result.ratio_median < 4.0
    assert result.to_dict()["speedup"] == result.speedup


class _FakeClock:
    """perf_counter for npu_core.bench that only the timed functions advance: exact timings."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: dict[str, int] = {}

    def __call__(self) -> float:
        return self.now

    def fn(self, name: str, seconds: float):
        def call() -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.now += seconds

        return call


def test_batched_samples_are_per_call_and_warmups_are_batches(monkeypatch):
    """calls=5: every sample is 5 back-to-back calls, recorded as the time of one."""
    clock = _FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    timing = bench.measure(clock.fn("A", 0.002), warmup=2, repeats=3, calls=5, sync=lambda: None)
    assert clock.calls == {"A": (2 + 3) * 5}
    assert timing.samples == pytest.approx((0.002,) * 3)
    syncs: list[int] = []
    result = bench.compare(
        clock.fn("B", 0.004), clock.fn("C", 0.001), warmup=1, repeats=4, calls=3,
        sync=lambda: syncs.append(1),
    )  # fmt: skip
    assert clock.calls["B"] == clock.calls["C"] == (1 + 4) * 3
    assert result.baseline.samples == pytest.approx((0.004,) * 4)
    assert result.candidate.samples == pytest.approx((0.001,) * 4)
    assert result.ratios == pytest.approx((4.0,) * 4)
    assert len(syncs) == 1 + 4 * 2 * 2  # after warm-up, then around every timed sample


def test_compare_can_pause_the_collector_and_restores_it():
    """pause_gc: no collection while timing; the collector is on again afterwards (and stays
    off when it was off before)."""
    seen: list[bool] = []

    def probe() -> None:
        seen.append(gc.isenabled())

    assert gc.isenabled()
    bench.compare(probe, probe, warmup=1, repeats=2, sync=lambda: None, pause_gc=True)
    assert seen and not any(seen) and gc.isenabled()
    seen.clear()
    bench.compare(probe, probe, warmup=1, repeats=2, sync=lambda: None)
    assert all(seen)
    gc.disable()
    try:
        bench.compare(probe, probe, repeats=1, sync=lambda: None, pause_gc=True)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_calls_per_sample_fills_the_sample_time(monkeypatch):
    """A 2 ms call fills a 20 ms sample 10 times; a call longer than the sample still gets one."""
    clock = _FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    assert bench.calls_per_sample(clock.fn("A", 0.002), 20.0, sync=lambda: None) == 10
    assert clock.calls["A"] == 2 + 5  # warm-up, then the probe's samples
    assert bench.calls_per_sample(clock.fn("B", 0.003), 1.0, sync=lambda: None) == 1
    assert bench.calls_per_sample(clock.fn("C", 0.0), 1.0, sync=lambda: None) == 10**6
    with pytest.raises(ValueError, match=r"sample_ms must be a positive number .* got 0"):
        bench.calls_per_sample(lambda: None, 0)


def test_markdown_formats_header_rows_and_numbers():
    """Header text as given, numeric columns right-aligned, floats with 3 significant digits."""
    table = bench.BenchTable("Copy speed", ["case", "time (ms)", "count"])
    table.add(case="small", **{"time (ms)": 0.123456}, count=3)
    table.add(case="big|one", **{"time (ms)": 1234.5678})
    lines = table.to_markdown().splitlines()
    assert lines[0] == "### Copy speed"
    assert lines[2] == "| case | time (ms) | count |"
    assert lines[3] == "| --- | ---: | ---: |"
    assert lines[4] == "| small | 0.123 | 3 |"
    assert lines[5] == "| big\\|one | 1235 |  |"
    assert lines[-1].startswith("Machine: ")


def test_tables_name_the_machine_they_ran_on(monkeypatch):
    """JSON and Markdown carry the CPU, its ISA, bf16 support, threads and any ISA cap."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # the run itself may be capped
    info = bench.environment_info()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["threads"] == torch.get_num_threads()
    assert isinstance(info["cpu_native_bf16"], bool) and isinstance(info["cpu_amx"], bool)
    assert isinstance(info["cpu_bf16_gemm_fast"], bool)
    assert info["isa_caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    line = bench.machine_line(info)
    assert info["cpu_model"] in line and info["cpu_capability"] in line
    assert f"{info['threads']} threads" in line and "ONEDNN_MAX_CPU_ISA=AVX2" in line
    assert bench.BenchTable("t", ["a"]).to_json()["environment"]["isa_caps"]
    emulated = bench.machine_line(info | {"cpu_native_bf16": True, "cpu_bf16_gemm_fast": False})
    assert "bf16 flag but bf16 GEMMs emulated" in emulated
    assert "native bf16 GEMMs" in bench.machine_line(info | {"cpu_bf16_gemm_fast": True})


def test_add_rejects_unknown_columns():
    """A misspelt column is an error rather than a silently dropped value."""
    table = bench.BenchTable("t", ["a"])
    with pytest.raises(ValueError, match=r"unknown columns \['b'\]"):
        table.add(a=1, b=2)


def test_write_is_atomic_and_parseable(tmp_path):
    """write() leaves exactly the two result files: valid JSON and the same Markdown table."""
    table = bench.BenchTable("Results", ["name", "ms"])
    table.add(name="x", ms=1.5)
    table.add(name="y")
    json_path, md_path = table.write(tmp_path / "out", "copy")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["copy.json", "copy.md"]
    data = json.loads(json_path.read_text())
    assert data["title"] == "Results"
    assert data["columns"] == ["name", "ms"]
    assert data["rows"] == [{"name": "x", "ms": 1.5}, {"name": "y", "ms": None}]
    assert md_path.read_text() == table.to_markdown()
    with pytest.raises(ValueError, match="plain file name"):
        table.write(tmp_path, "../escape")


def test_environment_info_identifies_software_not_machine():
    """The environment block has versions and counts, never the hostname or a path."""
    import os
    import socket

    info = bench.environment_info()
    assert {"torch", "backend", "python", "cpu_count"} <= set(info)
    text = json.dumps(info)
    host = socket.gethostname()
    assert host not in info.values()
    if len(host) >= 6:  # a very short name could match inside an unrelated value
        assert host not in text
    assert os.getcwd() not in text
    assert os.path.expanduser("~") not in text


def test_result_file_renders_its_own_machine_and_command(tmp_path, monkeypatch):
    """A committed result renders with the command and machine stamped in it, not the reader's."""
    monkeypatch.setattr(sys, "argv", ["packages/x/benchmarks/speed.py", "--out", "results"])
    table = bench.BenchTable("speed", ["case", "ratio"])
    table.add(case="a", ratio=1.234)
    json_path, _ = table.write(tmp_path, "speed")
    data = json.loads(json_path.read_text())
    assert data["command"] == "python packages/x/benchmarks/speed.py --out results"
    data["environment"]["cpu_model"] = "Another CPU"
    rendered = bench.render_result(data)
    assert "| a | 1.23 |" in rendered
    assert "Command: `python packages/x/benchmarks/speed.py --out results`" in rendered
    machine = rendered.rstrip().splitlines()[-1]
    assert machine.startswith("Machine: ") and "Another CPU" in machine
