"""Settings of ``modelzoo convert``, ``run`` and ``train``.

convert and run get their options generated from these models (``npu_core.cli.config_options``),
so ``--config FILE.toml`` and ``--set field=value`` reach every field and a bad value is refused
in one line with exit status 2 before any model is built. train's ``--config`` and ``--set``
address hyperparallel's ``TrainConfig`` instead, section for section as ``hyperparallel train``
takes them; :class:`TrainOptions` carries them to the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

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
    """``modelzoo train``: which weights train, and the run in the train job's own terms.

    The run itself is configured by hyperparallel's ``TrainConfig``, whose sections (``data``,
    ``optim``, ``parallel``, ``activation``, ...) ``job`` holds unchanged; it is validated by
    ``TrainConfig`` when the run starts (:func:`torchmind_modelzoo.training.train_config`), so
    modelzoo keeps no second copy of that schema.
    """

    tiny: bool = Field(
        False, description="Train the card's tiny shape from random weights (offline)."
    )
    path: Path | None = Field(
        None,
        description="Local model folder (a copy of the hub repo): its weights are loaded and "
        "its tokenizer used; not with --tiny.",
    )
    full_size: bool = Field(
        False,
        description="Train the card's real architecture (its published config) from random "
        "weights, offline, with bytes as tokens (no card ships a tokenizer); not with --tiny "
        "or --path.",
    )
    layers: int | None = Field(
        None,
        ge=1,
        description="With --full-size: keep the first N decoder layers, every other dimension "
        "as published (a real-proportion model that fits a small machine).",
    )
    job: dict[str, Any] = Field(
        default_factory=dict,
        description="hyperparallel TrainConfig values, nested by section as there (e.g. "
        "{'data': {'global_batch_size': 8}}), over the card run's defaults (JOB_DEFAULTS).",
    )

    @property
    def random_weights(self) -> bool:
        """Whether the card's shape is built from random weights (``--tiny``, ``--full-size``)."""
        return self.tiny or self.full_size


JOB_DEFAULTS: dict[str, Any] = {
    "parallel": {"nproc": 2, "mesh": "fsdp"},
    "steps": 20,
    "data": {"max_bytes": 1_000_000, "seq_len": 64, "batch_size": 4},
    "eval_batches": 2,
}
"""What a card run changes in hyperparallel's defaults: a short run on 2 ranks with a small
corpus. Evaluation and the checkpoint come at the last step and warm-up is a tenth of the steps
unless given (:func:`torchmind_modelzoo.training.train_config`)."""

JOB_FLAGS: dict[str, str] = {
    "nproc": "parallel.nproc",
    "mesh": "parallel.mesh",
    "steps": "steps",
    "data": "data.path",
    "max_bytes": "data.max_bytes",
    "seq_len": "data.seq_len",
    "batch_size": "data.batch_size",
    "seed": "seed",
    "out_dir": "out_dir",
}
"""``modelzoo train``'s shortcut options (``--seq-len``) and the TrainConfig key each one sets."""
