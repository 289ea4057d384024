"""``hyperparallel train --model ... --mesh pp=...``: transformers decoders cut into pipeline
stages train end to end, alone and with expert parallelism on the same mesh, under every schedule,
and their first-step loss is the single-process library loss of the same global batch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from typer.testing import CliRunner

from hyperparallel.cli import app
from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from packages.hyperparallel.tests.tiny_hf import FAMILIES, TINY_HF_SHAPE

STEPS = 3

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    **FAMILIES,
    "mla-moe-v3.2": (
        "DeepseekV32Config",
        {
            **FAMILIES["mla-moe"][1],
            "num_key_value_heads": 4,  # MLA: one key/value head per query head
            "index_topk": 4,  # below the sequence: the lightning indexer picks the keys
            "index_head_dim": 8,
            "index_n_heads": 2,
        },
    ),
}
"""The tiny families, and DeepSeek-V3.2 (MLA + MoE with the sparse-attention indexer)."""

LAYOUTS: dict[str, tuple[str, int, int, str, tuple[str, ...]]] = {
    "dense-1f1b": ("dense", 2, 1, "pp=2", ()),
    "dense-interleaved": ("dense", 4, 1, "pp=2", ("--pp-schedule", "interleaved_1f1b")),
    "dense-dualpipev": ("dense", 4, 1, "pp=2", ("--pp-schedule", "dualpipev")),
    "moe-pp": ("moe", 2, 1, "pp=2", ()),
    "moe-interleaved": ("moe", 4, 1, "pp=2", ("--pp-schedule", "interleaved_1f1b")),
    "moe-pp-ep": ("moe", 2, 2, "pp=2,ep=2", ()),
    "mla-moe-pp": ("mla-moe", 2, 1, "pp=2", ()),
    "mla-moe-pp-ep": ("mla-moe", 2, 2, "pp=2,ep=2", ()),
    "mla-moe-pp-ep-dualpipev": ("mla-moe", 4, 2, "pp=2,ep=2", ("--pp-schedule", "dualpipev")),
    "mla-moe-v3.2-pp-ep": ("mla-moe-v3.2", 2, 2, "pp=2,ep=2", ()),
}
"""Run name -> (family, decoder blocks, data-parallel ranks, mesh, more CLI arguments); the V and
looped schedules hold two stages per rank, so their decoders have four blocks."""


def _model(folder: Path, family: str, n_layers: int) -> Path:
    cls, extra = CONFIGS[family]
    config = getattr(transformers, cls)(**{**TINY_HF_SHAPE, **extra, "num_hidden_layers": n_layers})
    config.save_pretrained(folder)
    return folder


def _library_loss(folder: Path, dp_ranks: int) -> float:
    """Independent reference: the transformers model (same seed) in one process, its own logits
    and F.cross_entropy over every data-parallel rank's first batch; no stages, no FSDP."""
    cfg = load_config(debug(), overrides=[f"hf.source={str(folder)!r}"])
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = encode(load_text(cfg.data.path, cfg.data.max_bytes), config.vocab_size)
    data = ByteBatches(ids, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)
    batches = [data.train_batch(0, rank, cfg.data.batch_size) for rank in range(dp_ranks)]
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def _train(model: Path, out: Path, mesh: str, nproc: int, *extra: str) -> dict[str, Any]:
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--preset",
            "debug",
            "--model",
            str(model),
            "--nproc",
            str(nproc),
            "--mesh",
            mesh,
            "--steps",
            str(STEPS),
            "--out-dir",
            str(out),
            *extra,  # a later --steps wins
        ],
    )
    assert result.exit_code == 0, result.output
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipelined_first_step_loss_equals_the_library_loss(layout: str, tmp_path: Path):
    family, n_layers, dp_ranks, mesh, extra = LAYOUTS[layout]
    nproc = 2 * dp_ranks  # pp=2 times the data-parallel ranks
    folder = _model(tmp_path / "model", family, n_layers)
    metrics = _train(folder, tmp_path / "out", mesh, nproc, *extra)
    losses = [r["loss"] for r in metrics["train"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - _library_loss(folder, dp_ranks)) < 1e-4
    assert metrics["config"]["parallel"]["mesh"] == mesh


@pytest.mark.distributed
@pytest.mark.slow  # four CLI runs of 10-20 steps (80 s to 4 min on a loaded 2-core machine)
def test_moe_stages_track_fsdp_and_resume_from_an_fsdp_checkpoint(tmp_path: Path):
    """Qwen3-MoE on ``pp=2,ep=2`` (4 ranks) against FSDP2 on 2 ranks, the same global batch:
    20 steps within 1e-3 (the per-stage balance loss is the only difference), and an FSDP
    checkpoint of step 10 resumes on ``pp=2,ep=2`` (DCP reshards into stages and expert
    shards) to the same tolerance."""
    folder = _model(tmp_path / "model", "moe", 2)
    steps = ("--steps", "20")
    fsdp = _train(folder, tmp_path / "fsdp", "fsdp", 2, *steps)
    piped = _train(folder, tmp_path / "pp", "pp=2,ep=2", 4, *steps)
    want = [r["loss"] for r in fsdp["train"]]
    got = [r["loss"] for r in piped["train"]]
    assert len(got) == len(want) == 20
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3

    out = tmp_path / "resumed"
    _train(folder, out, "fsdp", 2, "--steps", "10", "--set", "checkpoint_every=10")
    resumed = _train(folder, out, "pp=2,ep=2", 4, *steps, "--resume")
    losses = [r["loss"] for r in resumed["train"]]
    assert losses[:10] == want[:10]  # kept from the FSDP run's metrics
    assert max(abs(a - b) for a, b in zip(losses[10:], want[10:], strict=True)) < 1e-3
