"""Settings of ``modelzoo convert`` and ``modelzoo run``: the fields are the command-line options.

Both commands get their options generated from these models (``npu_core.cli.config_options``),
so ``--config FILE.toml`` and ``--set field=value`` reach every field and a bad value is refused
in one line with exit status 2 before any model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from npu_core.config import StrictConfig

DType = Literal["float32", "bfloat16", "float16"]


class SourceOptions(StrictConfig):
    """Where the weights come from and how the model is built (shared by convert and run)."""

    tiny: bool = Field(False, description="Tiny random-weight model from the card, offline.")
    path: Path | None = Field(
        None, description="Local model folder (a copy of the hub repo); not with --tiny."
    )
    dtype: DType | None = Field(
        None, description="Weight dtype; default float32 for --tiny, else the card's dtype."
    )
    trust_remote_code: bool = Field(
        False, description="Allow code from the model folder (never implied)."
    )
    mfusion: bool = Field(
        False,
        description="Compile with Inductor and the card's mfusion options (fused_ops, "
        "convert.mfusion) and record what mfusion did.",
    )


class ConvertOptions(SourceOptions):
    """``modelzoo convert``: where the artefact goes."""

    # Optional only in the model: npu_core.cli validates --config/--set before it applies the
    # options given on the command line, so a required field could not come from its option.
    out: Path | None = Field(
        None, description="Output folder for the artefact and manifest.json (required)."
    )
    overwrite: bool = Field(
        False, description="Replace a previous conversion in --out (only its files)."
    )


class RunOptions(SourceOptions):
    """``modelzoo run``: how the example runs."""

    nproc: int = Field(1, ge=1, description="Local ranks (liteboost Ulysses / VAE DP).")
    prompt: str = Field(
        "The capital of France is", description="Prompt when a tokenizer is in --path."
    )
    boost: bool = Field(True, description="Apply the card's liteboost options.")
