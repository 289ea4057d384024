"""User-facing settings of mfusion, validated on construction, fingerprinted for Inductor.

A leaf module: it imports the machine profile and the pass and backend registries (data)
only, so every other
module can depend on it without an import cycle.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mfusion.backends.registry import BackendName, select_backend
from mfusion.machine import MachineProfile
from mfusion.passes.registry import PASS_REGISTRY
from npu_core.config import ConfigError, StrictConfig, describe_errors


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


class LinearKernelPolicy(enum.StrEnum):
    """Which GEMM library runs a frozen fp32 linear (the ``linear_kernel`` pass)."""

    MEASURE = "measure"
    """Time MKL's and oneDNN's packed GEMM for each shape on this machine (cached) and take
    oneDNN only where it is clearly faster."""
    ONEDNN = "onednn"
    """oneDNN wherever the form allows (you measured it pays here)."""
    INDUCTOR = "inductor"
    """Keep Inductor's choice (MKL for static-shape fp32 on x86)."""


class ConvLayoutPolicy(enum.StrEnum):
    """The memory layout of convolutions whose weights are graph inputs (the ``conv_layout``
    pass)."""

    MEASURE = "measure"
    """Time both layouts for the graph's convolutions on this machine (cached) and keep NCHW
    only where Inductor's channels-last layout is clearly slower."""
    NCHW = "nchw"
    """Keep NCHW wherever Inductor would switch to channels-last (you measured it pays here)."""
    INDUCTOR = "inductor"
    """Keep Inductor's choice (channels-last on CPUs with oneDNN)."""


class MFusionConfig(StrictConfig):
    """Everything that changes what mfusion does to a graph.

    A strict, frozen pydantic model (``npu_core.config.StrictConfig``): unknown fields are
    refused, so a misspelt option fails instead of silently running the defaults, and the model
    can be loaded from TOML with ``--set field=value`` overrides (:meth:`load`). Every field feeds
    :meth:`fingerprint`, which is part of the pass's ``uuid()``: flipping any of them makes
    Inductor's FX graph cache miss instead of serving a graph built with old settings.

    Raises:
        ConfigError: (a ``ValueError``) one line naming each invalid field, its value and what
            is allowed.
    """

    backend: BackendName = Field(
        BackendName.AUTO,
        description="Kernel backend for auto-fused regions; 'auto' picks 'npu' when torch_npu "
        "sees a device, else 'inductor' (regions stay Inductor-lowerable).",
    )
    passes: tuple[str, ...] | None = Field(
        None,
        description="Names of the hand-written passes to run, in order; None runs every "
        "registered pass (mfusion.PASS_REGISTRY).",
    )
    auto_fuse: bool = Field(
        True,
        description="Plan fusion regions over the whole graph with the backend's capability "
        "table and outline them for backends that generate their own kernels.",
    )
    rope_low_precision: bool = Field(
        False,
        description="Also rewrite RoPE in bf16/fp16. Off by default: the rewritten form rounds "
        "differently from the eager chain of bf16 ops, so results drift from eager.",
    )
    absorb_matmul_casts: bool = Field(
        True,
        description="Let mm(a.float(), b.float()).to(bf16) run as a bf16 matmul (fp32 "
        "accumulation, one rounding); changes low-order bits relative to the fp32 matmul.",
    )
    patch_conv: PatchConvPolicy = Field(
        PatchConvPolicy.AUTO,
        description="Where the patch_conv pass may rewrite: 'auto' (only where measured to pay), "
        "'on' or 'off'.",
    )
    linear_kernel: LinearKernelPolicy = Field(
        LinearKernelPolicy.MEASURE,
        description="GEMM library of frozen fp32 linears: 'measure' (time MKL and oneDNN per "
        "shape on this machine, cached), 'onednn' or 'inductor' (keep MKL).",
    )
    conv_layout: ConvLayoutPolicy = Field(
        ConvLayoutPolicy.MEASURE,
        description="Layout of convolutions whose weights are graph inputs (training, inference "
        "without freezing) on CPU: 'measure' (time channels-last, with its per-call weight "
        "conversions, against NCHW on this machine, cached), 'nchw' or 'inductor' "
        "(channels-last).",
    )
    chunked_cross_entropy: bool = Field(
        False,
        description="Training: rewrite linear + cross-entropy (mean, ignore_index) in the joint "
        "graph into chunked custom ops that never save [tokens, vocab] logits (peak memory), "
        "at the cost of one more head GEMM. Off by default: it slows the step (see README).",
    )
    chunked_cross_entropy_bytes: int = Field(
        64 << 20,
        ge=1,
        description="Largest chunk of fp32 logits the chunked cross-entropy computes at once "
        "(rows = bytes // (4 * vocab)); losses whose whole logits fit in it are left alone.",
    )
    machine: MachineProfile | None = Field(
        None,
        description="The machine the machine-dependent rewrites (matmul_cast, patch_conv) decide "
        "for; None detects this process's (CPU, ISA caps, threads). Tests pass a fixed profile.",
    )
    min_region_ops: int = Field(
        2,
        description="Smallest auto-fused region worth outlining (ops, not counting views). Not "
        "a speed tuning: a one-op region is already one kernel.",
    )
    max_region_ops: int = Field(
        64,
        description="Largest auto-fused region; larger groups are split. Bounds the quadratic "
        "split search and the JIT's compile time, not a measured speed threshold.",
    )

    def __init__(self, **data: Any) -> None:
        # Direct construction (install(), compile_options()) gets the same one-line error as
        # StrictConfig.load(), naming the field, the value and what is allowed.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid mfusion option: {describe_errors(exc)}") from None

    @field_validator("backend", "patch_conv", "linear_kernel", "conv_layout", mode="before")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        """An enum field's value, or one line naming the field, the value and what is allowed."""
        assert info.field_name is not None
        choices = cls.model_fields[info.field_name].annotation
        assert isinstance(choices, type) and issubclass(choices, enum.Enum)
        try:
            return choices(value)
        except ValueError:
            allowed = ", ".join(c.value for c in choices)
            raise ValueError(
                f"{info.field_name}={value!r} is not known; use one of: {allowed}"
            ) from None

    @field_validator("machine", mode="before")
    @classmethod
    def _profile(cls, value: Any) -> Any:
        if value is None or isinstance(value, MachineProfile):
            return value
        if isinstance(value, dict):  # from a TOML table
            return MachineProfile(**value)
        raise ValueError(f"machine={value!r} must be a mfusion.machine.MachineProfile or None")

    @field_validator("passes", mode="before")
    @classmethod
    def _known_passes(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        passes = tuple(value)
        unknown = [p for p in passes if p not in PASS_REGISTRY]
        if unknown:
            raise ValueError(
                f"passes={unknown} are not known; available passes: {sorted(PASS_REGISTRY)}"
            )
        return passes

    @model_validator(mode="after")
    def _region_bounds(self) -> MFusionConfig:
        if not 1 <= self.min_region_ops <= self.max_region_ops:
            raise ValueError(
                f"need 1 <= min_region_ops <= max_region_ops, got {self.min_region_ops}, "
                f"{self.max_region_ops}"
            )
        return self

    def resolved_backend(self) -> BackendName:
        """The concrete backend: ``auto`` resolved by the plug-in rule (``npu`` where torch_npu
        sees a device, else ``inductor``), a named one checked to run here.

        Raises:
            PluginError: the named backend cannot run on this machine (says why).
        """
        return select_backend(self.backend)

    def resolved_machine(self) -> MachineProfile:
        """The injected profile, or this process's (detected now: threads may have changed)."""
        return self.machine if self.machine is not None else MachineProfile.detect()

    def fingerprint(self) -> str:
        """Stable hash of every field (the base's canonical JSON of the validated values), of what
        ``auto`` resolves to here and of the machine profile the machine-dependent rewrites
        decide for. Extends :meth:`StrictConfig.fingerprint`, which sees the declared fields
        only: ``machine=None`` means "this machine", which the base cannot tell apart."""
        fields = {
            "options": super().fingerprint(),
            "resolved_backend": self.resolved_backend().value,
            "machine": self.resolved_machine().fingerprint(),
        }
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()
