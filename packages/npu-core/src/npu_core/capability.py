"""What the hardware under this process can do fast, decided from its capability and confirmed
by measurement.

Low-precision GEMMs are the clearest case of one decision that cannot be taken once for every
machine: a bf16 matmul is a native instruction on CUDA (sm80+), Ascend NPUs and CPUs with
AVX512-BF16 or AMX, but on an AVX2-only CPU oneDNN emulates it, ~75x slower than fp32 (measured:
256x1024 @ 1024x256 in 131 ms bf16 vs 1.75 ms fp32, one thread). The CPU flags alone are not
enough either: ``ONEDNN_MAX_CPU_ISA=AVX2`` (or a container's CPU model) can take the fast path
away while ``/proc/cpuinfo`` still lists the flag. :func:`fast_matmul` therefore asks the
capability first (cheap; a "no" is final) and confirms a "yes" with one timing of the dtype
against fp32, cached per (device, dtype) for the life of the process.

Callers that must be tested on any machine take the decision as an argument (a
:data:`MatmulSpeedProbe`) instead of calling :func:`fast_matmul` directly, so a test can say "this
device has fast bf16" without owning such a device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from npu_core import env
from npu_core.device import synchronizer

MatmulSpeedProbe = Callable[[torch.device, torch.dtype], bool]
"""(device, dtype) -> whether GEMMs in ``dtype`` are at least as fast as fp32 there."""

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that give native low-precision GEMMs.
_NATIVE_FLAGS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},
    torch.float16: {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"},
}

# The GEMM that confirms a capability: large enough that emulation shows (bf16 emulated on AVX2
# takes ~35 ms here, native ~0.4 ms), small enough to cost nothing where it is fast.
_PROBE_SHAPE = (256, 512, 256)
_PROBE_ROUNDS = 3


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
        return bool(self.flags & _NATIVE_FLAGS[torch.bfloat16])

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


def usable_cpu_count() -> int:
    """CPUs this process may run on: its affinity mask (``taskset``, cgroups' cpusets), not the
    machine's total, which ``os.cpu_count()`` reports and which oversubscribes a pinned job."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def threads_per_process(processes: int) -> int:
    """Intra-op threads for each of ``processes`` CPU-heavy processes sharing this CPU set.

    The usable CPUs split evenly, at least one each: N ranks each running a full-width pool thrash
    the cores they share (torchrun makes the same choice with OMP_NUM_THREADS=1 for several local
    ranks). An explicit ``OMP_NUM_THREADS`` from the user wins.
    """
    if processes < 1:
        raise ValueError(f"processes={processes} is invalid; it must be >= 1")
    forced = env.read(env.OMP_NUM_THREADS)
    if forced is not None and forced.isdigit() and int(forced) > 0:
        return int(forced)
    return max(1, usable_cpu_count() // processes)


def claims_fast_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """What the device's declared capability says about GEMMs in ``dtype`` (no measurement).

    fp32 and fp64 are always "fast" (the reference). CUDA: fp16 always, bf16 where
    ``torch.cuda.is_bf16_supported()`` (sm80+). NPU: Ascend cube units take fp16 and bf16 (910B
    and later; torch_npu reports bf16 support where it can). CPU: the flags of :func:`cpu_info`.
    """
    if dtype not in LOW_PRECISION:
        return True
    if device.type == "cuda":
        return dtype is torch.float16 or torch.cuda.is_bf16_supported()
    if device.type == "npu":
        supported = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
        return dtype is torch.float16 or supported is None or bool(supported())
    if device.type == "cpu":
        return bool(cpu_info().flags & _NATIVE_FLAGS[dtype])
    return False


def measured_speed_ratio(device: torch.device, dtype: torch.dtype) -> float:
    """Time of a ``_PROBE_SHAPE`` GEMM in ``dtype`` over the same GEMM in fp32 (min of rounds).

    Rounds alternate the two dtypes so a neighbour's load hits both; the minimum is the least
    disturbed sample of each. Below 1 means ``dtype`` is faster.
    """
    m, k, n = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a32 = torch.randn(m, k, generator=generator).to(device)
    b32 = torch.randn(k, n, generator=generator).to(device)
    operands = {torch.float32: (a32, b32), dtype: (a32.to(dtype), b32.to(dtype))}
    sync = synchronizer(device)
    best = dict.fromkeys(operands, float("inf"))
    for round_index in range(_PROBE_ROUNDS + 1):
        for kind, (a, b) in operands.items():
            sync()
            start = time.perf_counter()
            a @ b
            sync()
            if round_index:  # round 0 warms up (kernel selection, lazy init)
                best[kind] = min(best[kind], time.perf_counter() - start)
    return best[dtype] / max(best[torch.float32], 1e-9)


_DECISIONS: dict[tuple[torch.device, torch.dtype], bool] = {}


def fast_matmul(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether GEMMs in ``dtype`` are at least as fast as fp32 on ``device``; cached.

    The capability answers first (:func:`claims_fast_matmul`); a claimed fast path is confirmed
    by :func:`measured_speed_ratio` <= 1 once per (device, dtype) and process. The threshold needs
    no tuning: native paths measure ~0.1-0.5, emulated ones ~20-80.
    """
    device = torch.device(device)
    key = (device, dtype)
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = claims_fast_matmul(device, dtype) and (
            dtype not in LOW_PRECISION or measured_speed_ratio(device, dtype) <= 1.0
        )
        _DECISIONS[key] = decision
    return decision


def clear_decisions() -> None:
    """Forget the cached :func:`fast_matmul` answers and CPU facts (tests that fake them)."""
    _DECISIONS.clear()
    cpu_info.cache_clear()
