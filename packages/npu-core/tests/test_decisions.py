"""npu_core.decisions and npu_core.timing: the fastest candidate wins, once per (fields, machine
profile), cached on disk atomically; switches, fallbacks and unreadable files. Every timer here is
a fake: no outcome depends on the speed of the machine running the tests."""

from __future__ import annotations

import json

import pytest

from npu_core import decisions, machine, timing
from npu_core.decisions import DecisionCache, decide
from npu_core.timing import use_timer

PROFILE = {"cpu": "test CPU", "isa": "AVX2", "threads": 1, "torch": "2.x"}
CANDIDATES = {"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}


class FakeTimer:
    """Fixed seconds per candidate; records which candidates it was asked to time."""

    def __init__(self, **seconds: float) -> None:
        self.seconds = seconds
        self.asked: list[list[str]] = []

    def __call__(self, calls):
        self.asked.append(list(calls))
        return {name: self.seconds[name] for name in calls}


@pytest.fixture(autouse=True)
def _measuring(monkeypatch, tmp_path):
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    monkeypatch.setenv("NPU_CORE_CACHE_DIR", str(tmp_path))
    decisions.forget()
    yield
    decisions.forget()


def _decide(**kwargs):
    options = {"fallback": "a", "profile": PROFILE} | kwargs
    return decide("test", {"n": 4}, options.pop("candidates", CANDIDATES), **options)


def test_fake_timer_picks_the_fastest_and_the_file_records_it(tmp_path):
    timer = FakeTimer(a=3.0, b=1.0, c=2.0)
    with use_timer(timer):
        decision = _decide()
    assert decision.name == "b" and decision.source == "measured"
    assert decision.seconds == {"a": 3.0, "b": 1.0, "c": 2.0}
    assert timer.asked == [["a", "b", "c"]]
    [path] = (tmp_path / "test").glob("*.json")
    record = json.loads(path.read_text())
    assert record["choice"] == "b" and record["fields"] == {"n": 4}
    assert record["machine"] == PROFILE


def test_cache_hit_does_not_time_again_in_this_or_a_new_process():
    with use_timer(FakeTimer(a=1.0, b=2.0, c=3.0)):
        assert _decide().name == "a"
    with use_timer(pytest.fail):
        assert _decide().source == "cache"
        decisions.forget()  # what a new process remembers: nothing, the file answers
        again = _decide()
    assert again.name == "a" and again.source == "cache" and again.seconds["b"] == 2.0


def test_key_includes_the_machine_profile_and_the_fields():
    timer = FakeTimer(a=1.0, b=2.0, c=3.0)
    with use_timer(timer):
        _decide()
        _decide(profile=PROFILE | {"threads": 2})
        _decide(profile=PROFILE | {"torch": "2.y"})
        decide("test", {"n": 5}, CANDIDATES, fallback="a", profile=PROFILE)
    assert len(timer.asked) == 4
    assert decisions.decision_key({"n": 4}, PROFILE) != decisions.decision_key(
        {"n": 4}, PROFILE | {"isa": "AVX512"}
    )


def test_default_profile_is_this_machine(tmp_path):
    with use_timer(FakeTimer(a=1.0, b=2.0, c=3.0)):
        decide("test", {"n": 4}, CANDIDATES, fallback="a")
    [path] = (tmp_path / "test").glob("*.json")
    assert json.loads(path.read_text())["machine"] == machine.machine_profile("cpu")
    assert {"cpu", "isa", "onednn_isa_cap", "threads", "torch", "device"} <= set(
        machine.machine_profile("cpu")
    )


def test_baseline_keeps_ties_within_min_gain():
    """A rival must save ``min_gain`` of the baseline's time; without a margin a tie goes to it."""
    assert decisions.pick({"new": 0.98, "old": 1.0}, baseline="old", min_gain=0.03) == "old"
    assert decisions.pick({"new": 0.96, "old": 1.0}, baseline="old", min_gain=0.03) == "new"
    assert decisions.pick({"new": 1.0, "old": 1.0}, baseline="old") == "new"
    assert decisions.pick({"new": 1.1, "old": 1.0}, baseline="old") == "old"


def test_candidates_are_built_only_when_timing_is_due():
    built = []

    def build():
        built.append(1)
        return CANDIDATES

    with use_timer(FakeTimer(a=1.0, b=2.0, c=3.0)):
        _decide(candidates=build)
        _decide(candidates=build)
    assert built == [1]


@pytest.mark.parametrize("mode", ["fallback", "cached"])
def test_switches_take_the_fallback_without_timing(monkeypatch, tmp_path, mode):
    monkeypatch.setenv("NPU_CORE_DECISIONS", mode)
    with use_timer(pytest.fail):
        decision = _decide(fallback="c")
    assert decision.name == "c" and decision.seconds is None and mode in decision.source
    assert not (tmp_path / "test").exists()


def test_cached_mode_reads_what_was_measured(monkeypatch):
    with use_timer(FakeTimer(a=2.0, b=1.0, c=3.0)):
        _decide()
    decisions.forget()
    monkeypatch.setenv("NPU_CORE_DECISIONS", "cached")
    with use_timer(pytest.fail):
        assert _decide().name == "b"


def test_unknown_mode_and_foreign_fallback_are_refused(monkeypatch):
    refused = pytest.raises(ValueError, match="fallback 'z' is not one of the candidates")
    with refused, use_timer(FakeTimer(a=1.0, b=1.0, c=1.0)):
        _decide(fallback="z")
    monkeypatch.setenv("NPU_CORE_DECISIONS", "sometimes")
    with pytest.raises(ValueError, match="NPU_CORE_DECISIONS='sometimes' is not known"):
        _decide()


def test_corrupt_cache_file_is_ignored_with_a_warning_and_replaced(tmp_path):
    cache = DecisionCache(tmp_path)
    key = decisions.decision_key({"n": 4}, PROFILE)
    path = cache.path("test", key)
    path.parent.mkdir(parents=True)
    path.write_text('{"choice": "b", "seconds"')
    warned = pytest.warns(RuntimeWarning, match="unreadable decision file")
    with use_timer(FakeTimer(a=1.0, b=2.0, c=3.0)), warned:
        decision = _decide(cache=cache)
    assert decision.name == "a" and decision.source == "measured"
    assert json.loads(path.read_text())["choice"] == "a"


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A write that fails half way (disk full) leaves neither the file nor a temporary one."""
    real = type(tmp_path).write_text

    def half_then_fail(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", half_then_fail)
    with use_timer(FakeTimer(a=1.0, b=2.0, c=3.0)), pytest.raises(OSError, match="No space"):
        _decide()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_timer_scope_and_nesting():
    outer, inner = FakeTimer(a=1.0, b=2.0, c=3.0), FakeTimer(a=3.0, b=2.0, c=1.0)
    with use_timer(outer), use_timer(inner, namespace="other"):
        assert _decide().name == "a"  # "test" is not the inner block's scope
        assert decide("other", {}, CANDIDATES, fallback="a", profile=PROFILE).name == "c"


def test_interleaved_timer_rotates_the_order_and_takes_medians(monkeypatch):
    order: list[str] = []
    samples = {"x": iter([5.0, 1.0, 2.0]), "y": iter([3.0, 9.0, 4.0])}

    def fake_sample(fn, sample_s, sync):
        name = fn()
        order.append(name)
        return next(samples[name])

    monkeypatch.setattr(timing, "per_call_seconds", fake_sample)
    seen = timing.interleaved_timer({"x": lambda: "x", "y": lambda: "y"}, rounds=3)
    assert seen == {"x": 2.0, "y": 4.0}
    assert order == ["x", "y", "y", "x", "x", "y"]


def test_per_call_seconds_batches_short_calls_and_keeps_a_long_one(monkeypatch):
    clock = iter([0.0, 0.001, 1.0, 1.004, 10.0, 10.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    calls = []
    assert timing.per_call_seconds(lambda: calls.append(1), 0.0045) == pytest.approx(0.001)
    assert len(calls) == 1 + 4  # one probe call, then 4 calls (0.0045 / 0.001) in one sample
    assert timing.per_call_seconds(lambda: calls.append(1), 0.004) == 0.5
    assert len(calls) == 6  # a call longer than the sample is the sample
