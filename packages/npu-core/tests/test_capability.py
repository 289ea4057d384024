"""npu_core.capability: capability claims, the measured confirmation, and the cached decision."""

from __future__ import annotations

import pytest
import torch

from npu_core import capability, machine
from npu_core.timing import use_timer


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch, tmp_path):
    """Each test measures into its own cache, with nothing remembered from another test."""
    monkeypatch.setenv("NPU_CORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NPU_CORE_DECISIONS", "measure")
    capability.clear_decisions()
    yield
    capability.clear_decisions()


def _fake_cpu(monkeypatch, flags: set[str]) -> None:
    info = machine.CpuInfo("Test CPU", "AVX2", frozenset(flags), onednn_isa_cap=None)
    monkeypatch.setattr(capability, "cpu_info", lambda: info)


def test_fp32_is_always_fast_and_never_measured():
    """The reference dtype needs no probe: measuring it against itself would be wasted time."""
    with use_timer(pytest.fail):
        assert capability.fast_matmul("cpu", torch.float32)
        assert capability.fast_matmul("cpu", torch.float64)


def test_cpu_without_bf16_flags_is_decided_without_measuring(monkeypatch):
    """An AVX2-only CPU emulates bf16: the capability's "no" is final, nothing is timed."""
    _fake_cpu(monkeypatch, {"avx2", "fma"})
    with use_timer(pytest.fail):
        assert not capability.claims_fast_matmul(torch.device("cpu"), torch.bfloat16)
        assert not capability.fast_matmul("cpu", torch.bfloat16)


@pytest.mark.parametrize(("bf16_s", "expected"), [(0.4, True), (1.0, True), (40.0, False)])
def test_claimed_bf16_is_confirmed_by_measurement_once(monkeypatch, tmp_path, bf16_s, expected):
    """AVX512-BF16 in the flags is a claim; the timing of both GEMMs decides (a cap on oneDNN
    can void it), once: later calls and a new process read the cached answer."""
    _fake_cpu(monkeypatch, {"avx2", "avx512f", "avx512_bf16"})
    timed = []

    def fake_timer(calls):
        timed.append(sorted(calls))
        results = {name: call() for name, call in calls.items()}
        torch.testing.assert_close(results["bfloat16"].float(), results["fp32"], rtol=0.05, atol=1)
        return {"fp32": 1.0, "bfloat16": bf16_s}

    with use_timer(fake_timer):
        assert capability.fast_matmul("cpu", torch.bfloat16) is expected
        assert capability.fast_matmul(torch.device("cpu"), torch.bfloat16) is expected
    assert timed == [["bfloat16", "fp32"]]
    assert len(list((tmp_path / capability.DECISION_NAMESPACE).glob("*.json"))) == 1
    capability.clear_decisions()
    with use_timer(pytest.fail):
        assert capability.fast_matmul("cpu", torch.bfloat16) is expected


def test_claim_stands_where_measuring_is_off(monkeypatch):
    """``NPU_CORE_DECISIONS=fallback``: the flags answer alone, nothing is timed."""
    monkeypatch.setenv("NPU_CORE_DECISIONS", "fallback")
    _fake_cpu(monkeypatch, {"avx512_bf16"})
    with use_timer(pytest.fail):
        assert capability.fast_matmul("cpu", torch.bfloat16)


def test_arm_bf16_and_amx_flags_count_as_native():
    """Arm's "bf16" feature and Intel's AMX tiles are native bf16 paths too."""
    arm = machine.CpuInfo("Neoverse", "SVE256", frozenset({"asimd", "bf16"}), None)
    amx = machine.CpuInfo("Xeon", "AVX512", frozenset({"amx_tile", "amx_bf16"}), None)
    plain = machine.CpuInfo("Old", "AVX2", frozenset({"avx2"}), "AVX2")
    assert arm.native_bf16 and amx.native_bf16 and amx.amx and not plain.native_bf16
    assert "oneDNN capped at AVX2" in plain.summary()


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
