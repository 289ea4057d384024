"""Facts about the machine a process runs on: its CPU as torch sees it, and the profile that keys
every measured decision (:mod:`npu_core.decisions`).

A decision measured on one machine holds only where the same kernels run at the same speeds: the
same CPU model, the ISA ATen and oneDNN may use (both can be capped by environment variables), the
intra-op thread count, the accelerator, and the torch build that supplies the kernels. The profile
holds exactly those; nothing in it identifies one machine (no serials, no hostnames).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from pathlib import Path

import torch

from npu_core import env
from npu_core.device import device_module

# Flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that give native low-precision GEMMs.
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}),
}

Profile = dict[str, str | int]
"""What a measured decision holds for: string and integer facts, compared for equality."""


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """The CPU as torch sees it. Nothing here identifies one machine (no serials, no hostnames)."""

    model: str
    """Marketing name, e.g. ``"AMD EPYC"``; ``platform.machine()`` where the OS does not say."""
    isa: str
    """The vector ISA ATen dispatches to (``torch.backends.cpu.get_cpu_capability()``), after
    ``ATEN_CPU_CAPABILITY`` caps it: ``"AVX2"``, ``"AVX512"``, ``"SVE256"``, ``"DEFAULT"``..."""
    flags: frozenset[str]
    """CPU feature flags the OS reports (empty where it reports none)."""
    onednn_isa_cap: str | None
    """``ONEDNN_MAX_CPU_ISA`` when set: oneDNN (CPU bf16 GEMMs and convolutions) stops there."""

    @property
    def native_bf16(self) -> bool:
        """The CPU has bf16 dot-product instructions (AVX512-BF16, AMX or Arm BF16)."""
        return bool(self.flags & NATIVE_FLAGS[torch.bfloat16])

    @property
    def amx(self) -> bool:
        return any(flag.startswith("amx") for flag in self.flags)

    def summary(self) -> str:
        """One line for benchmark tables, e.g. ``AMD EPYC, AVX512, native bf16``."""
        parts = [self.model, self.isa, "native bf16" if self.native_bf16 else "no native bf16"]
        if self.amx:
            parts.append("AMX")
        if self.onednn_isa_cap:
            parts.append(f"oneDNN capped at {self.onednn_isa_cap}")
        return ", ".join(parts)


def _read_cpuinfo() -> tuple[str | None, frozenset[str]]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None, frozenset()
    model = None
    flags: frozenset[str] = frozenset()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if model is None and key in ("model name", "hardware", "cpu model"):
            model = value.strip() or None
        elif not flags and key in ("flags", "features"):
            flags = frozenset(value.split())
        if model is not None and flags:
            break
    return model, flags


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU of this process (read once; the ISA cap variables are read at that moment)."""
    model, flags = _read_cpuinfo()
    return CpuInfo(
        model=model or platform.processor() or platform.machine() or "unknown",
        isa=torch.backends.cpu.get_cpu_capability(),
        flags=flags,
        onednn_isa_cap=env.read(env.ONEDNN_MAX_CPU_ISA),
    )


@functools.cache
def accelerator_name(device: torch.device) -> str:
    """The accelerator model behind ``device`` (e.g. ``NVIDIA H100 80GB HBM3, sm90``); empty for
    the CPU and for device types npu_core does not drive."""
    module = device_module(device.type) if device.type in ("cuda", "npu") else None
    if module is None:
        return ""
    index = device.index if device.index is not None else module.current_device()
    name = str(module.get_device_name(index))
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        name += f", sm{major}{minor}"
    return name


def machine_profile(device: torch.device | str = "cpu") -> Profile:
    """The facts a decision measured for ``device`` holds under (read now: the thread count may
    have changed since the last call)."""
    device = torch.device(device)
    cpu = cpu_info()
    return {
        "arch": platform.machine().lower(),
        "cpu": cpu.model,
        "isa": cpu.isa,
        "onednn_isa_cap": cpu.onednn_isa_cap or "",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
        "accelerator": accelerator_name(device),
    }
