"""Small training configs for checking the planner against real gloo runs: the built-in MoE and
two transformers families (dense Qwen3, Qwen3-MoE) at a tiny size, under any mesh."""

from __future__ import annotations

from pathlib import Path

import transformers

from hyperparallel.train.config import TrainConfig, load_config
from hyperparallel.train.presets import debug
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE

BASE = (
    "model.n_layers=2",
    "data.global_batch_size=8",
    "data.max_bytes=200000",
    "optim.ns_dtype='fp32'",
)
HF_FAMILIES = {"qwen3": transformers.Qwen3Config, "qwen3-moe": transformers.Qwen3MoeConfig}


def tiny_config(tmp_path: Path, family: str, mesh: str, extra: tuple[str, ...] = ()) -> TrainConfig:
    """A debug-preset job of ``family`` (``"moe"``: the built-in MoE; else a key of
    :data:`HF_FAMILIES`, whose config is written under ``tmp_path``) on ``mesh``."""
    overrides = [f"parallel.mesh={mesh!r}", f"out_dir={str(tmp_path)!r}", *BASE, *extra]
    if family != "moe":
        fields = {**TINY_HF_SHAPE, "vocab_size": 256}
        if family == "qwen3-moe":
            fields.update(QWEN3_MOE)
        HF_FAMILIES[family](**fields).save_pretrained(tmp_path / family)
        overrides.append(f"hf.source={str(tmp_path / family / 'config.json')!r}")
    return load_config(debug(), overrides=overrides)
