"""User-facing settings of mfusion, validated on construction, fingerprinted for Inductor."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json

from mfusion.machine import MachineProfile
from mfusion.passes.registry import PASS_REGISTRY
from npu_core import detect_backend


class PatchConvPolicy(enum.StrEnum):
    """When ``patch_conv`` turns a convolution into im2col + GEMM."""

    AUTO = "auto"
    """Where its shape rule was measured to pay: this CPU's ISA level and the dtype are in
    ``mfusion.passes.patch_conv.MEASURED``; elsewhere (other ISA levels, other devices) the
    convolution is kept."""
    ON = "on"
    """Apply the shape rule on any machine and device (you measured it pays there)."""
    OFF = "off"
    """Keep every convolution."""


class BackendName(enum.StrEnum):
    """Kernel backends a fused region can be handed to."""

    AUTO = "auto"
    INDUCTOR = "inductor"
    MLIR_CPU = "mlir-cpu"
    NPU = "npu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MFusionConfig:
    """Everything that changes what mfusion does to a graph.

    Every field feeds :meth:`fingerprint`, which is part of the pass's ``uuid()``: flipping any of
    them makes Inductor's FX graph cache miss instead of serving a graph built with old settings.
    """

    backend: BackendName = BackendName.AUTO
    """Kernel backend for auto-fused regions; ``auto`` picks ``npu`` when torch_npu sees a device,
    else ``inductor`` (regions stay Inductor-lowerable)."""

    passes: tuple[str, ...] | None = None
    """Names of the hand-written passes to run, in order; ``None`` runs every default pass."""

    auto_fuse: bool = True
    """Plan fusion regions over the whole graph with the backend's capability table and outline
    them for backends that generate their own kernels."""

    rope_low_precision: bool = False
    """Also rewrite RoPE in bf16/fp16. Off by default: the rewritten form rounds differently from
    the eager chain of bf16 ops, so results drift from eager."""

    absorb_matmul_casts: bool = True
    """Let ``mm(a.float(), b.float()).to(bf16)`` run as a bf16 matmul (fp32 accumulation, one
    rounding). Changes low-order bits relative to the fp32 matmul."""

    patch_conv: PatchConvPolicy = PatchConvPolicy.AUTO
    """Where the ``patch_conv`` pass may rewrite: ``auto`` (only where measured to pay),
    ``on`` or ``off``; see :class:`PatchConvPolicy`."""

    machine: MachineProfile | None = None
    """The machine the machine-dependent rewrites (``matmul_cast``, ``patch_conv``) decide for;
    None detects this process's (CPU, ISA caps, threads). Tests pass a fixed profile."""

    min_region_ops: int = 2
    """Smallest auto-fused region worth outlining (ops, not counting views). Not a speed tuning:
    a one-op region is already one kernel, so outlining it never saves a pass over memory."""

    max_region_ops: int = 64
    """Largest auto-fused region; larger groups are split. Bounds the quadratic split search and
    the JIT's compile time, not a measured speed threshold."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "backend", BackendName(self.backend))
        except ValueError:
            allowed = ", ".join(b.value for b in BackendName)
            raise ValueError(
                f"backend={self.backend!r} is not known; use one of: {allowed}"
            ) from None
        try:
            object.__setattr__(self, "patch_conv", PatchConvPolicy(self.patch_conv))
        except ValueError:
            allowed = ", ".join(p.value for p in PatchConvPolicy)
            raise ValueError(
                f"patch_conv={self.patch_conv!r} is not known; use one of: {allowed}"
            ) from None
        if self.machine is not None and not isinstance(self.machine, MachineProfile):
            raise ValueError(
                f"machine={self.machine!r} must be a mfusion.machine.MachineProfile or None"
            )
        if self.passes is not None:
            passes = tuple(self.passes)
            unknown = [p for p in passes if p not in PASS_REGISTRY]
            if unknown:
                raise ValueError(
                    f"passes={unknown} are not known; available passes: {sorted(PASS_REGISTRY)}"
                )
            object.__setattr__(self, "passes", passes)
        if not 1 <= self.min_region_ops <= self.max_region_ops:
            raise ValueError(
                f"need 1 <= min_region_ops <= max_region_ops, got {self.min_region_ops}, "
                f"{self.max_region_ops}"
            )

    def resolved_backend(self) -> BackendName:
        """The concrete backend ``auto`` stands for on this machine."""
        if self.backend != BackendName.AUTO:
            return self.backend
        return BackendName.NPU if detect_backend().value == "npu" else BackendName.INDUCTOR

    def resolved_machine(self) -> MachineProfile:
        """The injected profile, or this process's (detected now: threads may have changed)."""
        return self.machine if self.machine is not None else MachineProfile.detect()

    def fingerprint(self) -> str:
        """Stable hash of every field, of what ``auto`` resolves to here and of the machine
        profile the machine-dependent rewrites decide for."""
        fields = dataclasses.asdict(self) | {
            "resolved_backend": self.resolved_backend().value,
            "machine": self.resolved_machine().fingerprint(),
        }
        text = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()
