"""Settings of ``modelzoo convert``, ``run`` and ``train``: the fields are the command-line options.

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


class TrainOptions(StrictConfig):
    """``modelzoo train``: a full LLM card trained with hyperparallel (FSDP2/HSDP, Muon)."""

    tiny: bool = Field(
        False, description="Train the card's tiny shape from random weights (offline)."
    )
    path: Path | None = Field(
        None,
        description="Local model folder (a copy of the hub repo): its weights are loaded and "
        "its tokenizer used; not with --tiny.",
    )
    nproc: int = Field(2, ge=1, description="Local ranks to spawn (ignored under torchrun).")
    mesh: str = Field(
        "fsdp",
        description="hyperparallel mesh over the ranks: 'fsdp' (all ranks shard), 'RxS' "
        "(HSDP: R replicas of S shards) or 'ep=2,dp_shard=1' (expert parallelism, MoE cards); "
        "pp is not supported for these models.",
    )
    steps: int = Field(20, ge=1, description="Optimizer steps (a resumed run included).")
    data: Path | None = Field(
        None, description="Text or JSONL file, or a folder of text; default: Python's stdlib."
    )
    max_bytes: int = Field(1_000_000, ge=8192, description="Bytes of text read from --data.")
    seq_len: int = Field(64, ge=8, description="Tokens per sample.")
    batch_size: int = Field(4, ge=1, description="Samples per data-parallel rank per step.")
    seed: int = Field(0, description="Seed of the random weights and of the data order.")
    out_dir: Path | None = Field(
        None,
        description="Run folder: model/config.json (--tiny), metrics.json, loss.png, "
        "checkpoints; default runs/train/<card>.",
    )
