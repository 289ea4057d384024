"""The model card schema: one pydantic model per card file, unknown keys forbidden.

A card is data only. Checks that need an installed library (does the architecture class exist?)
live in :mod:`torchmind_modelzoo.validate`, so that reading and listing cards never imports torch
models.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from npu_core.config import StrictConfig


class Category(enum.StrEnum):
    """The six model families the zoo covers."""

    LLM = "llm"
    VLM = "vlm"
    IMAGE = "image-generation"
    VIDEO = "video-generation"
    SPEECH = "speech"
    EMBEDDING = "embedding"


class Status(enum.StrEnum):
    """``full``: conversion config and runnable example; ``listed``: card data only."""

    FULL = "full"
    LISTED = "listed"


class Task(enum.StrEnum):
    """Which inference example a full card runs (see :mod:`torchmind_modelzoo.examples`)."""

    TEXT_GENERATION = "text-generation"
    IMAGE_TEXT_GENERATION = "image-text-generation"
    EMBEDDING = "embedding"
    RERANK_LM = "rerank-lm"
    RERANK_CROSS_ENCODER = "rerank-cross-encoder"
    IMAGE_TEXT = "image-text"
    ASR = "asr"
    IMAGE_DENOISE = "image-denoise"
    VIDEO_DENOISE = "video-denoise"


class _Strict(StrictConfig):
    """Unknown keys refused, frozen, ``true`` refused for numbers (npu_core's config base)."""


class Parallelism(_Strict):
    """Recommended parallel degrees for serving the full-size model."""

    tensor: int = Field(1, ge=1, description="Tensor-parallel degree (weights split per layer).")
    sequence: int = Field(1, ge=1, description="Sequence-parallel degree (activations split).")
    ulysses: int = Field(1, ge=1, description="Ulysses all-to-all degree over attention heads.")
    expert: int = Field(1, ge=1, description="Expert-parallel degree for MoE layers.")


class Attention(_Strict):
    """Attention kernel and sparsity recommended for this model."""

    backend: Literal["sdpa", "flash", "flex", "eager", "npu", "auto"] = Field(
        "sdpa", description="Attention implementation to request from the runtime."
    )
    sparsity: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of key blocks skipped by block-sparse attention."
    )
    kind: str = Field("full", description="Attention variant (full, sliding, mla, linear, ...).")


class ConvertConfig(_Strict):
    """How ``modelzoo convert`` turns the model into a deployable artefact."""

    method: Literal["export", "safetensors"] = Field(
        "export",
        description="'export': torch.export program (.pt2); 'safetensors': weights + config "
        "where the forward is not exportable (data-dependent routing, remote code).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight dtype of the artefact."
    )
    dynamic: dict[str, dict[int, str]] = Field(
        default_factory=dict,
        description="Dynamic-shape spec: input name -> {dim index: dim name}. Empty: static.",
    )
    dim_max: int = Field(256, ge=2, description="Upper bound for every dynamic dimension.")
    liteboost: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options for liteboost.BoostManager (video models).",
    )
    mfusion: dict[str, Any] = Field(
        default_factory=dict,
        description="mfusion.MFusionConfig settings applied by convert/run --mfusion; 'passes' "
        "defaults to the passes named by fused_ops.",
    )


class ExampleConfig(_Strict):
    """Inputs of the tiny inference example."""

    task: Task = Field(description="Which example to run.")
    seq_len: int = Field(8, ge=1, description="Prompt (or decoder prompt) length in tokens.")
    new_tokens: int = Field(4, ge=0, description="Tokens to generate greedily.")
    steps: int = Field(2, ge=1, description="Denoising steps for diffusion models.")
    latent_shape: list[int] = Field(
        default_factory=list, description="Latent shape for diffusion models, batch excluded."
    )
    text_len: int = Field(6, ge=1, description="Length of the text conditioning for diffusion.")
    pooling: Literal["last", "mean", "cls"] = Field(
        "last", description="Token pooling for embedding models."
    )
    audio_seconds: float = Field(1.0, gt=0, description="Length of the synthetic waveform (ASR).")
    boost_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="liteboost options that differ for the tiny model (e.g. a sparse block "
        "size that fits its few latent tokens).",
    )
    expert_boundary: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Two-expert denoisers (Wan2.2 A14B): timesteps above boundary * 1000 use the "
        "high-noise expert, the rest the low-noise one.",
    )


_LIBRARY = re.compile(r"^(transformers|diffusers|other:[a-z0-9_.-]+)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelCard(_Strict):
    """One model of the zoo. Field names are the YAML keys of a card file."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$", description="Short slug, unique.")
    category: Category = Field(description="One of the six families.")
    hub_id: str = Field(description="Hugging Face repo id (the diffusers-format repo if any).")
    library: str = Field(description="'transformers', 'diffusers' or 'other:<package>'.")
    architecture: str = Field(description="Model class (the denoiser class for diffusers).")
    model_type: str = Field(description="config.json model_type (denoiser class for diffusers).")
    pipeline: str | None = Field(None, description="diffusers pipeline class, where one exists.")
    params_b: float = Field(gt=0, description="Total parameters in billions (MoE total).")
    active_params_b: float | None = Field(None, gt=0, description="Active parameters (MoE).")
    license: str = Field(description="SPDX-like licence id; 'other' is named in notes.")
    precision: Literal["bf16", "fp16", "fp32", "fp8", "mxfp4", "int4"] = Field(
        description="Precision the released weights are meant to run in."
    )
    parallelism: Parallelism = Field(default_factory=Parallelism)
    attention: Attention = Field(default_factory=Attention)
    fused_ops: list[str] = Field(
        default_factory=list,
        description="Ops worth fusing; they name the mfusion passes --mfusion runs.",
    )
    hardware: str = Field(description="Memory and device notes for the full-size model.")
    min_versions: dict[str, str] = Field(
        default_factory=dict, description="Minimum versions of the libraries it needs."
    )
    remote_code: bool = Field(
        False, description="Class lives in the hub repo: needs trust_remote_code, never implied."
    )
    notes: str = Field("", description="What is assumed rather than read from the model's files.")
    status: Status = Field(description="'full' (convert + example) or 'listed'.")
    tiny: dict[str, Any] = Field(
        default_factory=dict, description="Config overrides that make a tiny random-weight model."
    )
    config: dict[str, Any] | None = Field(
        None,
        description="The published config.json's architecture values (what the library's config "
        "class needs to build the real-size model; no tokenizer ids): `modelzoo train "
        "--full-size` trains this shape from random weights, offline.",
    )
    convert: ConvertConfig | None = Field(None, description="Conversion config (full cards).")
    example: ExampleConfig | None = Field(None, description="Inference example (full cards).")

    @field_validator("library")
    @classmethod
    def _check_library(cls, value: str) -> str:
        if not _LIBRARY.match(value):
            raise ValueError(f"library {value!r}: use transformers, diffusers or other:<package>")
        return value

    @field_validator("hub_id")
    @classmethod
    def _check_hub_id(cls, value: str) -> str:
        if not _HUB_ID.match(value):
            raise ValueError(f"hub_id {value!r} is not of the form owner/name")
        return value

    @model_validator(mode="after")
    def _check_full(self) -> ModelCard:
        if self.status is Status.FULL:
            missing = [k for k in ("convert", "example") if getattr(self, k) is None]
            if not self.tiny:
                missing.append("tiny")
            if missing:
                raise ValueError(f"status 'full' needs {', '.join(missing)}")
            if self.remote_code:
                raise ValueError("status 'full' is not allowed for remote_code cards")
        return self

    @property
    def package(self) -> str:
        """Python package that provides ``architecture`` (import name)."""
        if self.library.startswith("other:"):
            return self.library.split(":", 1)[1].replace("-", "_")
        return self.library

    def summary(self) -> dict[str, Any]:
        """The columns of ``modelzoo list`` (JSON-friendly)."""
        return {
            "id": self.id,
            "category": self.category.value,
            "hub_id": self.hub_id,
            "architecture": self.architecture,
            "params_b": self.params_b,
            "license": self.license,
            "status": self.status.value,
        }
