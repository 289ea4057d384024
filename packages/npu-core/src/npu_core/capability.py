"""What the hardware under this process can do fast, decided from its capability and confirmed
by measurement.

Low-precision GEMMs are the clearest case of one decision that cannot be taken once for every
machine: a bf16 matmul is a native instruction on CUDA (sm80+), Ascend NPUs and CPUs with
AVX512-BF16 or AMX, but on an AVX2-only CPU oneDNN emulates it, ~75x slower than fp32 (measured:
256x1024 @ 1024x256 in 131 ms bf16 vs 1.75 ms fp32, one thread). The CPU flags alone are not
enough either: ``ONEDNN_MAX_CPU_ISA=AVX2`` (or a container's CPU model) can take the fast path
away while ``/proc/cpuinfo`` still lists the flag. :func:`fast_matmul` therefore asks the
capability first (cheap; a "no" is final) and confirms a "yes" by timing the dtype against fp32
through :func:`npu_core.decisions.decide`: once per machine profile, cached on disk.

Callers that must be tested on any machine take the decision as an argument (a
:data:`MatmulSpeedProbe`) instead of calling :func:`fast_matmul` directly, so a test can say "this
device has fast bf16" without owning such a device.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from npu_core import decisions, env, machine
from npu_core.machine import NATIVE_FLAGS, cpu_info
from npu_core.timing import Call

MatmulSpeedProbe = Callable[[torch.device, torch.dtype], bool]
"""(device, dtype) -> whether GEMMs in ``dtype`` are at least as fast as fp32 there."""

LOW_PRECISION = (torch.bfloat16, torch.float16)

# The GEMM that confirms a capability: large enough that emulation shows (bf16 emulated on AVX2
# takes ~35 ms here, native ~0.4 ms), small enough to cost nothing where it is fast.
PROBE_SHAPE = (256, 512, 256)

DECISION_NAMESPACE = "matmul-speed"


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
    and later; torch_npu reports bf16 support where it can). CPU: the flags of
    :func:`npu_core.machine.cpu_info`.
    """
    if dtype not in LOW_PRECISION:
        return True
    if device.type == "cuda":
        return dtype is torch.float16 or torch.cuda.is_bf16_supported()
    if device.type == "npu":
        supported = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
        return dtype is torch.float16 or supported is None or bool(supported())
    if device.type == "cpu":
        return bool(cpu_info().flags & NATIVE_FLAGS[dtype])
    return False


def _probe_gemms(device: torch.device, dtype: torch.dtype) -> dict[str, Call]:
    """One :data:`PROBE_SHAPE` GEMM in fp32 and one in ``dtype`` on ``device``, same values."""
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a32 = torch.randn(m, k, generator=generator).to(device)
    b32 = torch.randn(k, n, generator=generator).to(device)
    a_low, b_low = a32.to(dtype), b32.to(dtype)
    return {"fp32": lambda: a32 @ b32, str(dtype).removeprefix("torch."): lambda: a_low @ b_low}


def fast_matmul(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether GEMMs in ``dtype`` are at least as fast as fp32 on ``device``.

    The capability answers first (:func:`claims_fast_matmul`); a claimed fast path is confirmed
    by timing both GEMMs (:func:`npu_core.decisions.decide`, once per machine profile, cached on
    disk). The threshold needs no tuning: native paths measure ~0.1-0.5x fp32's time, emulated
    ones ~20-80x. Where measuring is switched off (``NPU_CORE_DECISIONS``) the claim stands.
    """
    device = torch.device(device)
    if dtype not in LOW_PRECISION:
        return True
    if not claims_fast_matmul(device, dtype):
        return False
    low = str(dtype).removeprefix("torch.")
    decision = decisions.decide(
        DECISION_NAMESPACE,
        {"dtype": low, "shape": list(PROBE_SHAPE)},
        lambda: _probe_gemms(device, dtype),
        fallback=low,
        baseline="fp32",
        device=device,
    )
    return decision.name == low


def clear_decisions() -> None:
    """Forget the decisions and CPU facts this process remembers (tests that fake them); the
    files on disk stay."""
    decisions.forget()
    machine.cpu_info.cache_clear()
