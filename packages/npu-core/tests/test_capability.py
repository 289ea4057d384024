"""npu_core.capability: capability claims, the measured confirmation, and the cached decision."""

from __future__ import annotations

import pytest
import torch

from npu_core import capability


@pytest.fixture(autouse=True)
def _fresh_decisions():
    capability.clear_decisions()
    yield
    capability.clear_decisions()


def _fake_cpu(monkeypatch, flags: set[str]) -> None:
    info = capability.CpuInfo(
        model="Test CPU", isa="AVX2", flags=frozenset(flags), onednn_isa_cap=None
    )
    monkeypatch.setattr(capability, "cpu_info", lambda: info)


def test_fp32_is_always_fast_and_never_measured(monkeypatch):
    """The reference dtype needs no probe: measuring it against itself would be wasted time."""
    monkeypatch.setattr(capability, "measured_speed_ratio", pytest.fail)
    assert capability.fast_matmul("cpu", torch.float32)
    assert capability.fast_matmul("cpu", torch.float64)


def test_cpu_without_bf16_flags_is_decided_without_measuring(monkeypatch):
    """An AVX2-only CPU emulates bf16: the capability's "no" is final, nothing is timed."""
    _fake_cpu(monkeypatch, {"avx2", "fma"})
    monkeypatch.setattr(capability, "measured_speed_ratio", pytest.fail)
    assert not capability.claims_fast_matmul(torch.device("cpu"), torch.bfloat16)
    assert not capability.fast_matmul("cpu", torch.bfloat16)


@pytest.mark.parametrize(("ratio", "expected"), [(0.4, True), (1.0, True), (40.0, False)])
def test_claimed_bf16_is_confirmed_by_measurement_once(monkeypatch, ratio, expected):
    """AVX512-BF16 in the flags is a claim; the timing decides (a cap on oneDNN can void it)."""
    _fake_cpu(monkeypatch, {"avx2", "avx512f", "avx512_bf16"})
    calls = []

    def probe(device, dtype):
        calls.append((device, dtype))
        return ratio

    monkeypatch.setattr(capability, "measured_speed_ratio", probe)
    assert capability.fast_matmul("cpu", torch.bfloat16) is expected
    assert capability.fast_matmul(torch.device("cpu"), torch.bfloat16) is expected
    assert calls == [(torch.device("cpu"), torch.bfloat16)]


def test_arm_bf16_and_amx_flags_count_as_native():
    """Arm's "bf16" feature and Intel's AMX tiles are native bf16 paths too."""
    arm = capability.CpuInfo("Neoverse", "SVE256", frozenset({"asimd", "bf16"}), None)
    amx = capability.CpuInfo("Xeon", "AVX512", frozenset({"amx_tile", "amx_bf16"}), None)
    plain = capability.CpuInfo("Old", "AVX2", frozenset({"avx2"}), "AVX2")
    assert arm.native_bf16 and amx.native_bf16 and amx.amx and not plain.native_bf16
    assert "oneDNN capped at AVX2" in plain.summary()


def test_measured_ratio_times_both_dtypes_after_a_warm_up(monkeypatch):
    """The probe runs one untimed round, then alternates the dtypes and keeps each one's best
    time: the ratio is bf16's best over fp32's best (timings faked, so no load can move it)."""
    ticks = iter(range(100))
    monkeypatch.setattr(capability.time, "perf_counter", lambda: next(ticks))
    seen = []
    real_matmul = torch.Tensor.__matmul__

    def recording(a, b):
        seen.append(a.dtype)
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", recording)
    ratio = capability.measured_speed_ratio(torch.device("cpu"), torch.bfloat16)
    rounds = capability._PROBE_ROUNDS + 1
    assert seen == [torch.float32, torch.bfloat16] * rounds
    assert ratio == 1.0  # every fake sample lasts one tick


def test_threads_split_the_usable_cpus_not_the_machine(monkeypatch):
    """Ranks share the CPUs this process may use (taskset / cpusets), at least one thread each."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(capability.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(capability.os, "cpu_count", lambda: 64)
    assert capability.usable_cpu_count() == 1
    assert capability.threads_per_process(4) == 1
    monkeypatch.setattr(
        capability.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False
    )
    assert capability.threads_per_process(1) == 8
    assert capability.threads_per_process(3) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert capability.threads_per_process(4) == 3
    with pytest.raises(ValueError, match="processes=0 is invalid"):
        capability.threads_per_process(0)
