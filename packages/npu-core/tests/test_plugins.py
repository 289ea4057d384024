"""npu_core.plugins: one selection rule, forced choices that never fall back silently."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from npu_core.plugins import DeviceDtype, Plugin, PluginError, Registry


@dataclass(frozen=True)
class Call:
    device: str
    dtype: torch.dtype
    requires_grad: bool = False


@dataclass(frozen=True)
class SmallOnly(DeviceDtype):
    max_len: int = 8

    def rejection(self, call) -> str | None:
        return super().rejection(call) or (
            f"length {call.length} (allowed: at most {self.max_len})"
            if getattr(call, "length", 0) > self.max_len
            else None
        )


def _registry() -> Registry:
    reg: Registry = Registry("test kernel")
    reg.register(Plugin("half_gpu", "A", DeviceDtype(("cuda",), (torch.bfloat16,)), priority=0))
    forward_only = DeviceDtype(None, (torch.float32,), differentiable=False)
    reg.register(Plugin("fwd_only", "B", forward_only, priority=10))
    reg.register(Plugin("missing", "C", DeviceDtype(), lambda: "pkg not importable", priority=20))
    reg.register(Plugin("fallback", "D", DeviceDtype()))
    return reg


def test_first_installed_plugin_that_accepts_wins():
    reg = _registry()
    assert reg.select(Call("cuda", torch.bfloat16)).impl == "A"
    assert reg.select(Call("cpu", torch.float32)).impl == "B"
    # needs a backward: the forward-only kernel is skipped, the uninstalled one too
    assert reg.select(Call("cpu", torch.float32, requires_grad=True)).impl == "D"
    assert reg.select(Call("cpu", torch.float16)).impl == "D"


def test_order_is_priority_then_registration():
    reg = _registry()
    assert reg.names() == ["half_gpu", "fwd_only", "missing", "fallback"]
    assert reg.installed() == ["half_gpu", "fwd_only", "fallback"]


def test_rejections_explain_every_plugin():
    reasons = _registry().rejections(Call("cpu", torch.float16, requires_grad=True))
    assert reasons == {
        "half_gpu": "device 'cpu' (allowed: cuda)",
        "fwd_only": "dtype float16 (allowed: float32)",
        "missing": "not installed (pkg not importable)",
        "fallback": None,
    }


def test_forced_choice_never_falls_back():
    reg = _registry()
    assert reg.select(Call("cpu", torch.float32), forced="fallback").impl == "D"
    with pytest.raises(PluginError, match="'half_gpu' cannot run this call: device 'cpu'"):
        reg.select(Call("cpu", torch.float32), forced="half_gpu")
    with pytest.raises(PluginError, match=r"'missing' cannot run this call: not installed"):
        reg.select(Call("cpu", torch.float32), forced="missing")
    with pytest.raises(PluginError, match="unknown test kernel 'nope'; choose one of half_gpu"):
        reg.select(Call("cpu", torch.float32), forced="nope")


def test_nothing_fits_names_each_reason():
    reg: Registry = Registry("test kernel")
    reg.register(Plugin("small", "S", SmallOnly(max_len=4)))

    @dataclass(frozen=True)
    class LongCall(Call):
        length: int = 9

    with pytest.raises(PluginError, match=r"small: length 9 \(allowed: at most 4\)"):
        reg.select(LongCall("cpu", torch.float32))


def test_installed_probe_runs_once():
    calls = []

    def probe() -> str | None:
        calls.append(1)
        return None

    reg: Registry = Registry("test kernel")
    reg.register(Plugin("p", "P", DeviceDtype(), probe))
    for _ in range(3):
        reg.select(Call("cpu", torch.float32))
    assert calls == [1]


def test_constraints_are_checked_before_the_install_probe():
    probed = []

    def probe() -> str | None:  # stands for an import or a kernel build
        probed.append(1)
        return None

    reg: Registry = Registry("test kernel")
    reg.register(Plugin("gpu_only", "G", DeviceDtype(("cuda",)), probe, priority=0))
    reg.register(Plugin("fallback", "F", DeviceDtype()))
    assert reg.select(Call("cpu", torch.float32)).impl == "F"
    assert probed == []
    assert reg.select(Call("cuda", torch.float32)).impl == "G"
    assert probed == [1]


def test_each_choice_logged_once(caplog: pytest.LogCaptureFixture):
    reg = _registry()
    with caplog.at_level(logging.INFO, logger="npu_core.plugins"):
        for _ in range(3):
            reg.select(Call("cpu", torch.float16))
        reg.select(Call("cpu", torch.float32))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("test kernel fallback for Call(device='cpu'")
    assert "half_gpu: device 'cpu' (allowed: cuda)" in messages[0]


def test_registered_is_scoped_and_names_are_unique():
    reg = _registry()
    extra = Plugin("extra", "E", DeviceDtype(), priority=-1)
    with reg.registered(extra):
        assert reg.select(Call("cpu", torch.float32)).impl == "E"
        with pytest.raises(ValueError, match="already registered"):
            reg.register(extra)
    assert "extra" not in reg.names()
    assert reg.select(Call("cpu", torch.float32)).impl == "B"
