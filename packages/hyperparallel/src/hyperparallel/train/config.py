"""The training configuration: nested pydantic models, unknown keys refused, every field described.

A run is configured by a preset (:mod:`presets`), then a TOML file, then ``--set a.b=value``
overrides, in that order; each layer is validated as a whole so errors name the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from hyperparallel._config import StrictModel as _Strict
from hyperparallel.activation.policy import POLICY_NAMES
from hyperparallel.models.moe import MoEConfig
from hyperparallel.train.profiling import parse_profile_steps

PARAMETER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``dtype`` setting -> the parameters' torch dtype."""


class DataConfig(_Strict):
    path: str | None = Field(
        None,
        description='Text file or folder to train on (with --model also JSONL, its "text" '
        "fields); default: the Python stdlib sources.",
    )
    max_bytes: int = Field(4_000_000, ge=8192, description="Bytes of text read from the source.")
    seq_len: int = Field(128, ge=8, description="Tokens (bytes) per training sample.")
    batch_size: int = Field(
        8, ge=1, description="Samples per data-parallel rank per step (see global_batch_size)."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per step over all data-parallel ranks (dp_replicate x ep x "
        "dp_shard); set it to compare layouts on the same batch. Overrides batch_size.",
    )
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="Held-out tail of the corpus.")


class OptimConfig(_Strict):
    muon_lr: float = Field(0.02, gt=0, description="Muon learning rate (hidden matrices).")
    adamw_lr: float = Field(
        3e-3, gt=0, description="AdamW learning rate (embeddings, head, norms)."
    )
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay for both.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor, times the lr.")
    balance_weight: float = Field(0.01, ge=0, description="Weight of the MoE load-balancing loss.")
    ns_dtype: Literal["auto", "bf16", "fp32", "fp16"] = Field(
        "auto",
        description="Newton-Schulz compute dtype: auto is bf16 where the device has fast bf16 "
        "GEMMs and fp32 elsewhere (CPUs without AVX512-BF16/AMX emulate bf16 ~75x slower).",
    )


class ParallelConfig(_Strict):
    nproc: int = Field(4, ge=1, description="Local ranks to spawn (ignored under torchrun).")
    mesh: str = Field(
        "fsdp",
        description="Named mesh sizes, e.g. 'pp=2,dp_shard=2', 'ep=2,dp_shard=2', "
        "'dp_replicate=2,dp_shard=2' (dims pp, dp_replicate, ep, dp_shard; product = ranks); "
        "'fsdp' = all ranks in dp_shard, 'RxS' = dp_replicate=R,dp_shard=S.",
    )
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "dualpipev"] = Field(
        "1f1b",
        description="Pipeline schedule under pp > 1: 1f1b, interleaved_1f1b (virtual_stages "
        "per rank), dualpipev (pairs one micro-batch's backward with another's forward).",
    )
    microbatches: int = Field(
        4, ge=1, description="Micro-batches per step under pp > 1; must divide the local batch."
    )
    pp_early_recompute: bool = Field(
        False,
        description="Under 1f1b / dualpipev, replay each micro-batch's checkpointed blocks "
        "ahead of its backward (dualpipev: right before the paired forward) instead of inside "
        "it; needs an activation policy that recomputes.",
    )
    virtual_stages: int = Field(
        2, ge=1, description="Stages per rank for interleaved_1f1b (V schedules use 2)."
    )
    ep_chunks: int = Field(
        1,
        ge=1,
        le=64,
        description="Under ep, groups of local experts whose compute overlaps the other groups' "
        "all-to-alls (1: exchange everything, then compute; measured faster on CPU/gloo).",
    )
    ep_local_first: bool = Field(
        False,
        description="Under ep, keep the tokens routed to a rank's own experts out of the "
        "all-to-alls and compute them while the others travel (needs ep_chunks=1; measured "
        "slower on CPU/gloo).",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a rank waits for its peers before the run fails: at start-up "
        "for every rank to arrive, then in each collective (a dead or stopped peer).",
    )

    @model_validator(mode="after")
    def _one_ep_overlap(self) -> ParallelConfig:
        if self.ep_local_first and self.ep_chunks > 1:
            raise ValueError(
                f"parallel.ep_local_first=true with parallel.ep_chunks={self.ep_chunks}: "
                "choose one overlap (ep_chunks=1 or ep_local_first=false)"
            )
        return self


class ActivationConfig(_Strict):
    policy: str = Field(
        "none",
        description="Per-block activation policy: none (no checkpoint), recompute, save, swap, "
        "selective (save matmuls, recompute the rest) or selective_swap.",
    )
    per_block: list[str] = Field(
        default_factory=list,
        description="Policy of block i (same names); blocks beyond the list use `policy`.",
    )
    swap_inputs: bool = Field(False, description="Swap each block's inputs to host after forward.")
    swap_threshold_bytes: int = Field(
        65536, ge=0, description="selective_swap: smallest saved output worth swapping."
    )
    offload_after: int = Field(
        0, ge=0, description="Offload block k's inputs when block k+N's forward starts."
    )
    prefetch_ahead: int = Field(
        1, ge=0, description="When backward reaches block k, bring back blocks k-1..k-N."
    )
    early_recompute: int = Field(
        0, ge=0, description="When backward reaches block k, recompute blocks k-1..k-N early."
    )

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ("none", *POLICY_NAMES):
            raise ValueError(f"{value!r}: choose none, {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("per_block")
    @classmethod
    def _known_each(cls, values: list[str]) -> list[str]:
        for value in values:
            cls._known(value)
        return values


class HFConfig(_Strict):
    """A `transformers` causal LM to train instead of the own MoE (:mod:`train.hf_model`)."""

    source: str | None = Field(
        None,
        description="A local transformers model folder (config.json, optionally weights and "
        "tokenizer files) or a config.json file; trains that architecture (dense, MoE, MLA+MoE "
        "families) instead of the built-in MoE. Nothing is downloaded.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Config fields replaced before building, e.g. a tiny shape "
        "(--set 'hf.overrides={num_hidden_layers=2, hidden_size=64}').",
    )
    load_weights: bool | None = Field(
        None,
        description="Load the folder's weights; default: load when the folder holds "
        "*.safetensors / pytorch_model*.bin and no overrides are given, else random weights "
        "from --seed (the same on every rank).",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer folder (local files only); default: the model folder when it "
        "holds tokenizer files, else bytes mapped into the vocabulary; 'bytes' forces bytes.",
    )


class TrainConfig(_Strict):
    model: MoEConfig = Field(
        default_factory=MoEConfig, description="Shape of the built-in MoE (unused with --model)."
    )
    hf: HFConfig = Field(default_factory=HFConfig, description="A transformers model (--model).")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus and batching.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizers.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Ranks, mesh.")
    activation: ActivationConfig = Field(
        default_factory=ActivationConfig, description="Activation recompute / swap per block."
    )
    steps: int = Field(200, ge=1, description="Optimizer steps in total (a resumed run included).")
    eval_every: int = Field(50, ge=1, description="Steps between validation passes.")
    eval_batches: int = Field(4, ge=1, description="Held-out batches per validation pass.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between DCP checkpoints.")
    keep_checkpoints: int = Field(
        3,
        ge=1,
        description="Newest checkpoints kept; older ones are removed after each save. The newest "
        "intact one always stays, even beyond this count when the newer ones are damaged.",
    )
    out_dir: str = Field("runs/train", description="Checkpoints, metrics.json and loss.png.")
    seed: int = Field(0, description="Seed of weights and data order (same on every rank).")
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Dtype of the parameters, and so of their gradients, optimizer state and "
        "activations: bf16 halves the model's memory, but an update below bf16's resolution "
        "(about 1/256 of a weight) is lost, and CPUs without AVX512-BF16/AMX run bf16 GEMMs "
        "~75x slower. The loss and Muon's exchanges stay fp32.",
    )
    profile_steps: str = Field(
        "",
        description="Steps to trace with torch.profiler (1-based, as in metrics.json), e.g. "
        "'3,4' or '3-6': one Chrome trace per rank and step in OUT_DIR/profile/rankR_stepS.json.",
    )

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _steps_parse(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `--set profile_steps=3` reads 3 as a number
        if isinstance(value, str):
            parse_profile_steps(value)  # raises with the item and the grammar
        return value

    @model_validator(mode="after")
    def _profiled_steps_run(self) -> TrainConfig:
        late = sorted(s for s in parse_profile_steps(self.profile_steps) if s > self.steps)
        if late:
            raise ValueError(
                f"profile_steps={self.profile_steps!r} names step {late[0]} but the run has "
                f"steps={self.steps}; profile steps 1..{self.steps}"
            )
        return self

    @model_validator(mode="after")
    def _fits_model(self) -> TrainConfig:
        # Found here, before ranks start, rather than as a ValueError in the first forward.
        # A transformers model's shape is in its config.json: its spec (train.hf_model) checks it.
        if self.hf.source is not None:
            return self
        hf = self.hf
        given = [
            name
            for name, value in (
                ("--tokenizer", hf.tokenizer),
                ("hf.overrides", hf.overrides or None),
                ("--load-weights", hf.load_weights),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a "
                "transformers model, and no --model (hf.source) is given; pass --model PATH or "
                "drop it"
            )
        if len(self.activation.per_block) > self.model.n_layers:
            raise ValueError(
                f"activation.per_block lists {len(self.activation.per_block)} policies but "
                f"model.n_layers={self.model.n_layers}; give at most one per block"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; lower data.seq_len or raise model.max_seq_len"
            )
        return self


def load_config(
    base: TrainConfig, toml_path: str | Path | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """Apply a TOML file, then ``key.sub=value`` overrides, to ``base``; validate the result.

    The layering and the override grammar are npu-core's (:meth:`StrictConfig.load`).

    Raises:
        ValueError: with every invalid field named (``model.n_heads: ...``).
    """
    return TrainConfig.load(base, toml_path, overrides)
