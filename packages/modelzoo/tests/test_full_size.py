"""``modelzoo train --full-size``: the cards' published configs, the config.json a run trains,
the summary's step medians, and the refusals (each writes nothing).

The published values are checked against the card's own ``params_b``: the architecture built
from them on the meta device (no memory) must have that many parameters. The command is run
with hyperparallel's launch replaced by one that writes a known ``metrics.json``, so the test
sees the written model and the summary without a training run of a real-size model.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from typer.testing import CliRunner

from torchmind_modelzoo import registry
from torchmind_modelzoo.build import model_class
from torchmind_modelzoo.cli import app

FULL_SIZE_CARDS = ["deepseek-v3.2", "qwen3-0.6b", "qwen3-30b-a3b-instruct-2507"]
SMALL = ["--max-bytes", "200000", "--seq-len", "32"]  # a data check of a second, not ten


def _parameters_on_meta(card_id: str, **changes: object) -> int:
    card = registry.get(card_id)
    assert card.config is not None
    cls = model_class(card)
    with torch.device("meta"):
        model = cls(cls.config_class(**{**card.config, **changes}))
    return sum(p.numel() for p in model.parameters())


def test_the_cards_with_a_published_config_are_the_two_filled():
    """deepseek-v3.2, qwen3-0.6b and qwen3-30b-a3b-instruct-2507 carry their config.json values;
    the others carry none rather than values nobody checked."""
    assert sorted(c.id for c in registry.list() if c.config is not None) == FULL_SIZE_CARDS


@pytest.mark.parametrize("card_id", FULL_SIZE_CARDS)
def test_published_config_builds_the_cards_parameter_count(card_id):
    """The architecture the card's config builds has the card's ``params_b`` within 2%: a wrong
    width, layer count, expert count or tying shows up as a different total."""
    card = registry.get(card_id)
    counted = _parameters_on_meta(card_id)
    assert counted == pytest.approx(card.params_b * 1e9, rel=0.02), counted


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["qwen3-0.6b", "--full-size", "--tiny"],
            "--full-size and --tiny exclude each other",
        ),
        (
            ["qwen3-0.6b", "--full-size", "--path", "weights"],
            "--full-size builds random weights and would ignore --path 'weights'",
        ),
        (
            ["qwen3-0.6b", "--tiny", "--layers", "2"],
            "--layers 2 applies only with --full-size",
        ),
        (
            ["qwen3-0.6b", "--full-size", "--layers", "29"],
            "--layers 29: qwen3-0.6b has num_hidden_layers=28; give 1 to 28",
        ),
        (
            ["qwen3-8b", "--full-size"],
            "qwen3-8b has no published config in its card (config:); --full-size trains "
            "deepseek-v3.2, qwen3-0.6b, qwen3-30b-a3b-instruct-2507",
        ),
        (["qwen3-0.6b"], "modelzoo never fetches weights), or --full-size (the published shape"),
    ],
)
def test_a_refused_full_size_run_writes_nothing(tmp_path, monkeypatch, args, expected):
    """Exit 2 with one ``error:`` line naming the options; no out-dir is created."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}\n")
    before = _tree(tmp_path)
    result = CliRunner().invoke(app, ["train", *args, "--out-dir", "tr", *SMALL])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert _tree(tmp_path) == before


def test_layers_zero_is_refused_by_the_option_check(tmp_path, monkeypatch):
    """``--layers 0`` is refused as a setting (at least one layer)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "qwen3-0.6b", "--full-size", "--layers", "0"])
    assert result.exit_code == 2 and "layers" in result.stderr, result.output
    assert not (tmp_path / "runs").exists()


def test_a_full_size_model_above_the_machines_memory_is_refused(tmp_path, monkeypatch):
    """Every rank builds the whole model in fp32 first: the 30.5 B published MoE on 2 ranks
    needs 244 GB, refused before anything is written, pointing at --layers."""
    from hyperparallel.train import memory

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: 64 * 2**30)
    result = CliRunner().invoke(
        app, ["train", "qwen3-30b-a3b-instruct-2507", "--full-size", "--out-dir", "tr", *SMALL]
    )
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    parameters = _parameters_on_meta("qwen3-30b-a3b-instruct-2507")
    assert f"has {parameters:,} parameters" in line and "--layers" in line, line
    assert not (tmp_path / "tr").exists()


STEPS = [  # what rank 0's metrics.json holds after a 4-step run (the job's own keys)
    {"step": 1, "tokens_per_s": 10.0, "backward_ms": 900.0, "optim_ms": 500.0,
     "peak_memory_mb": [4000.0, 4100.0]},
    {"step": 2, "tokens_per_s": 40.0, "backward_ms": 300.0, "optim_ms": 120.0,
     "peak_memory_mb": [3000.0, 3300.0]},
    {"step": 3, "tokens_per_s": 44.0, "backward_ms": 280.0, "optim_ms": 100.0,
     "peak_memory_mb": [3100.0, 3200.0]},
    {"step": 4, "tokens_per_s": 42.0, "backward_ms": 320.0, "optim_ms": 110.0,
     "peak_memory_mb": [3050.0, 3250.0]},
]  # fmt: skip


def _fake_start(seen: dict):
    """hyperparallel's ``job.start`` replaced: records the config, writes :data:`STEPS`."""
    from hyperparallel.train.trainer import TrainResult

    def start(cfg, **_):
        seen["cfg"] = cfg
        records = [{**r, "loss": 5.0} for r in STEPS]
        Path(cfg.out_dir, "metrics.json").write_text(json.dumps({"train": records, "val": []}))
        return [TrainResult(0, 0, 4, [5.0] * 4, [], 0, {})]

    return start


@pytest.mark.parametrize(
    ("card_id", "layers"), [("qwen3-0.6b", 3), ("qwen3-30b-a3b-instruct-2507", 1)]
)
def test_full_size_trains_the_published_config_cut_to_layers(
    tmp_path, monkeypatch, card_id, layers
):
    """OUT/model/config.json is the card's published config with ``num_hidden_layers`` the
    only change, trained from random weights; the summary gives the medians of steps 2-4 and
    each rank's peak memory."""
    from hyperparallel.train import job

    monkeypatch.chdir(tmp_path)
    seen: dict = {}
    monkeypatch.setattr(job, "start", _fake_start(seen))
    args = ["train", card_id, "--full-size", "--layers", str(layers), "--out-dir", "tr", *SMALL]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    written = AutoConfig.from_pretrained(tmp_path / "tr" / "model", local_files_only=True)
    card = registry.get(card_id)
    assert card.config is not None
    for key, value in card.config.items():
        # transformers 5 keeps rope_theta in rope_parameters
        stored = written.rope_parameters[key] if key == "rope_theta" else getattr(written, key)
        expected = layers if key == "num_hidden_layers" else value
        assert stored == expected, (key, stored, expected)
    assert written.architectures == [card.architecture]
    assert seen["cfg"].hf.load_weights is False and seen["cfg"].hf.tokenizer is None
    assert summary["full_size"] is True and summary["tiny"] is False
    later = STEPS[1:]
    assert summary["step_medians"] == {
        "steps": "2-4",
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
        "backward_ms": statistics.median(r["backward_ms"] for r in later),
        "optim_ms": statistics.median(r["optim_ms"] for r in later),
        "peak_memory_mb": [3050.0, 3250.0],
    }
