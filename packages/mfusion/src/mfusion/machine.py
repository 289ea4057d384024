"""What the machine offers to the rewrites whose payoff depends on it, and the rules tied to it.

Most mfusion passes do strictly less work on any machine (fewer ops per element, fewer passes
over memory, no extra copies) and need no machine check. Two kinds of rewrite trade one kernel
for another, and whether that pays depends on the CPU:

- a bf16/fp16 GEMM instead of an fp32 GEMM (``matmul_cast``) pays only where the CPU multiplies
  bf16/fp16 natively (AVX-512 BF16 or AMX); without it oneDNN emulates the low-precision GEMM,
  about 100x slower than the fp32 one (bf16 256x1024x256: 0.7 ms with AVX-512 BF16, 70 ms with
  oneDNN capped to AVX2);
- im2col + GEMM instead of a oneDNN convolution (``patch_conv``) is timed per convolution shape
  on the machine that compiles (``mfusion.passes.patch_conv``).

:class:`MachineProfile` captures those capabilities, read through ``npu_core.machine`` and
``npu_core.capability`` (CPU model, ATen ISA, flags, oneDNN cap; fast low-precision GEMMs from
the flags confirmed by one timing per machine and dtype, cached on disk).
:meth:`MachineProfile.detect` builds it (cheap after the first call);
tests inject a fixed one through ``MFusionConfig(machine=...)``. Its
:meth:`~MachineProfile.fingerprint`, measured answers included, is part of the pass manager's
``uuid()``: a graph compiled on one machine is never served from Inductor's FX cache on a machine
where these decisions could differ (another CPU, an ISA cap, another thread count).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform

import torch

from npu_core import capability
from npu_core.machine import cpu_info

# oneDNN's ISA names from the lowest to the highest (x86-64), as ONEDNN_MAX_CPU_ISA takes them.
ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)
_UNCAPPED = ("", "ALL", "DEFAULT")


def _onednn_allows(cap: str, isa: str) -> bool:
    """True if oneDNN capped at ``cap`` (``ONEDNN_MAX_CPU_ISA``) may use ``isa``.

    An unknown cap name counts as a cap below every named ISA: the caller then keeps the
    conservative choice instead of guessing.
    """
    cap = cap.upper()
    if cap in _UNCAPPED:
        return True
    if cap not in ONEDNN_ISAS:
        return False
    return ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """The CPU capabilities the machine-dependent rewrites are gated on.

    Build one with :meth:`detect`; tests construct one directly to pin a decision regardless of
    the machine they run on.
    """

    arch: str
    """``platform.machine()``: ``x86_64``, ``aarch64``, ..."""

    cpu_model: str
    """The CPU's model name; part of the fingerprint only (measured rules differ per CPU)."""

    cpu_capability: str
    """ATen's kernel level, ``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``,
    ``DEFAULT``, ... (lowered by ``ATEN_CPU_CAPABILITY``)."""

    onednn_max_isa: str = ""
    """``ONEDNN_MAX_CPU_ISA``; empty when oneDNN may use everything."""

    avx512_bf16: bool = False
    """The CPU has AVX-512 BF16 dot products."""

    amx: bool = False
    """The CPU has AMX tiles (bf16 and int8 matrix units)."""

    fast_bf16_gemm: bool = False
    """A CPU bf16 GEMM is at least as fast as the fp32 one here: the flags claim native bf16 and
    one timing against fp32 confirmed it (``npu_core.capability.fast_matmul``)."""

    fast_fp16_gemm: bool = False
    """The same for fp16 (AVX-512 FP16 or AMX-FP16, confirmed by one timing)."""

    threads: int = 1
    """``torch.get_num_threads()``: measured trade-offs between kernels move with it."""

    cuda_capability: tuple[int, int] | None = None
    """Compute capability of the current CUDA device; None without CUDA."""

    @classmethod
    def detect(cls) -> MachineProfile:
        """The profile of this process: CPU facts and ISA caps as ``npu_core.capability`` read
        them (once per process), the measured GEMM answers (cached per process) and the current
        thread count."""
        cpu = cpu_info()
        return cls(
            arch=platform.machine().lower(),
            cpu_model=cpu.model,
            cpu_capability=cpu.isa,
            onednn_max_isa=cpu.onednn_isa_cap or "",
            avx512_bf16="avx512_bf16" in cpu.flags,
            amx=cpu.amx,
            fast_bf16_gemm=capability.fast_matmul("cpu", torch.bfloat16),
            fast_fp16_gemm=capability.fast_matmul("cpu", torch.float16),
            threads=torch.get_num_threads(),
            cuda_capability=(
                torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            ),
        )

    @property
    def isa_level(self) -> str:
        """The x86-64 level both ATen and oneDNN may use, as measured rules are keyed:
        ``avx512-amx``, ``avx512-bf16``, ``avx512``, ``avx2``, or ``other`` (another
        architecture, or a lower or unknown level)."""
        if self.arch not in ("x86_64", "amd64"):
            return "other"
        cap = self.cpu_capability.upper()
        if cap.startswith("AVX512") and _onednn_allows(self.onednn_max_isa, "AVX512_CORE"):
            if self.amx and _onednn_allows(self.onednn_max_isa, "AVX512_CORE_AMX"):
                return "avx512-amx"
            if self.avx512_bf16 and _onednn_allows(self.onednn_max_isa, "AVX512_CORE_BF16"):
                return "avx512-bf16"
            return "avx512"
        if cap.startswith(("AVX2", "AVX512")) and _onednn_allows(self.onednn_max_isa, "AVX2"):
            return "avx2"
        return "other"

    def native_cpu_gemm(self, dtype: torch.dtype) -> bool:
        """True if a CPU GEMM in ``dtype`` is not slower than in fp32 here (not emulated).

        fp32/fp64 always; bf16/fp16 as measured (:attr:`fast_bf16_gemm`, :attr:`fast_fp16_gemm`).
        """
        if dtype in (torch.float32, torch.float64):
            return True
        if dtype == torch.bfloat16:
            return self.fast_bf16_gemm
        if dtype == torch.float16:
            return self.fast_fp16_gemm
        return False

    def describe(self) -> str:
        """One line for reports and refusal reasons."""
        cap = f", oneDNN cap {self.onednn_max_isa}" if self.onednn_max_isa else ""
        flags = [n for n in ("avx512_bf16", "amx") if getattr(self, n)]
        flags += [f"fast {d} GEMM" for d in ("bf16", "fp16") if getattr(self, f"fast_{d}_gemm")]
        return (
            f"{self.cpu_model} ({self.arch}, ATen {self.cpu_capability}{cap}, "
            f"{'+'.join(flags) or 'no bf16/AMX'}, torch threads {self.threads})"
        )

    def fingerprint(self) -> str:
        """Stable hash of every field."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def decision_profile(self) -> dict[str, object]:
        """What a measured decision (``npu_core.decisions.decide``) taken for this profile holds
        under: every field, plus the torch build whose kernels were timed."""
        return {**dataclasses.asdict(self), "torch": torch.__version__}


def native_gemm(machine: MachineProfile, dtype: torch.dtype, device: torch.device) -> bool:
    """True if a ``dtype`` GEMM on ``device`` is not slower than fp32 (see :meth:`native_cpu_gemm`).

    CUDA: bf16 tensor cores from compute capability 8.0, fp16 from 7.0. NPU (Ascend cube units):
    fp16 and bf16. Other devices: only fp32/fp64 (conservative).
    """
    if device.type == "cpu":
        return machine.native_cpu_gemm(dtype)
    if dtype in (torch.float32, torch.float64):
        return True
    if device.type == "cuda" and machine.cuda_capability is not None:
        return machine.cuda_capability[0] >= (8 if dtype == torch.bfloat16 else 7)
    return device.type == "npu" and dtype in (torch.bfloat16, torch.float16)
