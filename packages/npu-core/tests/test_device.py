"""npu_core.device: backend detection, comm backend mapping and environment overrides."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from npu_core import device, env


def test_detect_backend_matches_what_torch_sees(monkeypatch):
    """Without overrides: npu where torch_npu sees a device, else cuda where torch sees a GPU,
    else cpu; the expectation asks torch (and torch_npu) directly, not npu_core."""
    monkeypatch.delenv(env.BACKEND, raising=False)
    expected = device.Backend.CUDA if torch.cuda.is_available() else device.Backend.CPU
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.device_count() > 0:  # type: ignore[attr-defined]
            expected = device.Backend.NPU
    assert device.detect_backend() is expected


@pytest.mark.parametrize(("backend", "comm"), [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")])
def test_comm_backend_follows_compute_backend(monkeypatch, backend, comm):
    """Each compute backend maps to its collective library."""
    monkeypatch.delenv(env.COMM_BACKEND, raising=False)
    assert device.comm_backend(backend) == comm


def test_comm_backend_override_wins(monkeypatch):
    """NPU_CORE_COMM_BACKEND replaces the mapping, e.g. gloo on a GPU machine."""
    monkeypatch.setenv(env.COMM_BACKEND, "GLOO")
    assert device.comm_backend("cuda") is device.CommBackend.GLOO


def test_backend_override_rejects_unknown_name(monkeypatch):
    """A typo in the override names the variable, the value and the allowed choices."""
    monkeypatch.setenv(env.BACKEND, "tpu")
    with pytest.raises(ValueError, match=r"NPU_CORE_BACKEND='tpu'.*npu, cuda, cpu"):
        device.detect_backend()


def test_backend_override_rejects_missing_device(monkeypatch):
    """Forcing an accelerator that is not present fails at once, not inside a kernel."""
    missing = next((b for b in ("npu", "cuda") if not device.is_available(b)), None)
    if missing is None:
        pytest.skip("every accelerator is present")
    monkeypatch.setenv(env.BACKEND, missing)
    with pytest.raises(RuntimeError, match=f"no {missing} device"):
        device.detect_backend()


def test_cpu_override_and_device_for_rank(monkeypatch):
    """Forcing cpu always works and places every rank on the cpu device."""
    monkeypatch.setenv(env.BACKEND, "cpu")
    assert device.detect_backend() is device.Backend.CPU
    assert device.device_module() is None
    assert device.device_for_rank(3) == torch.device("cpu")


def test_synchronizer_is_the_device_modules_own_or_a_no_op():
    """CPU (and device types npu-core does not drive) need no sync; CUDA uses torch.cuda's."""
    assert device.synchronizer("cpu")() is None
    assert device.synchronizer(torch.device("meta"))() is None
    if torch.cuda.is_available():
        assert device.synchronizer("cuda:0") is torch.cuda.synchronize


def test_check_comm_backend_refuses_unknown_and_unusable_backends():
    from npu_core.device import check_comm_backend

    check_comm_backend("gloo")  # built into every torch this project supports, needs no device
    with pytest.raises(ValueError, match=r"unknown collective backend 'mpi2'; use one of: hccl"):
        check_comm_backend("mpi2")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'nccl' cannot run here .*usable here: gloo"):
            check_comm_backend("nccl")
    else:
        check_comm_backend("nccl")
