"""``modelzoo train``: every full LLM card trains with hyperparallel on 2 ranks, the command end
to end, weights from a local folder, and refusals before any rank starts.

Budget: starting a pair of ranks and importing transformers in them costs most of a run on a
small CPU machine, so the 20-step runs of all full LLM cards share one pair of ranks (the
hyperparallel trainer joins the launcher's process group; each run gets its own mesh, model,
optimizer and out-dir, exactly what ``modelzoo train`` would give it). Cards whose tiny
``config.json`` is the same text and whose training configuration is the same but for its
paths (e.g. deepseek-v3-0324, deepseek-v3.1 and both kimi-k2 cards: one architecture, one set
of tiny overrides) would train the very same run, so each distinct one trains once and its
checks hold for every card that wrote it (10 runs for the 21 cards). The command itself is run
once end to end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from typer.testing import CliRunner

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.data.tokens import encode, load_text
from hyperparallel.train.trainer import train_rank
from npu_core.dist import launch
from npu_core.run_record import RunRecord
from torchmind_modelzoo import registry
from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.cli import app
from torchmind_modelzoo.options import TrainOptions
from torchmind_modelzoo.training import (
    check_trainable,
    train_config,
    trainable_cards,
    write_tiny_config,
)

STEPS = 20
SMALL = {"max_bytes": 200_000, "seq_len": 32, "batch_size": 4}  # the job's data section


def _train_all(cfgs: list) -> list[list[float]]:
    """One rank: each configuration trained in turn in the launcher's process group."""
    return [train_rank(cfg, False).train_losses for cfg in cfgs]


def _without_paths(cfg) -> str:
    """The training configuration but for the card's own paths (its config.json, its out-dir)."""
    return json.dumps(cfg.model_dump(exclude={"out_dir": True, "hf": {"source"}}), sort_keys=True)


def _reference_first_loss(cfg, folder: Path) -> float:
    """Single process, the library's own logits and F.cross_entropy: the first-step loss of the
    weights in ``folder`` on both ranks' first batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = encode(load_text(cfg.data.path, cfg.data.max_bytes), model.config.vocab_size)
    data = ByteBatches(ids, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)
    batches = [data.train_batch(0, rank, cfg.data.batch_size) for rank in (0, 1)]
    inputs, targets = (torch.cat([b[i] for b in batches]) for i in (0, 1))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def test_trainable_cards_are_the_full_llm_cards():
    ids = [c.id for c in trainable_cards()]
    assert len(ids) == 21 and "qwen3-0.6b" in ids and "deepseek-v3.2" in ids
    assert all(registry.get(i).architecture.endswith("ForCausalLM") for i in ids)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_every_full_llm_card_trains_tiny_for_20_steps_on_2_ranks(tmp_path: Path):
    """All full LLM cards, tiny shape, 20 steps of FSDP2 + Muon on 2 ranks, seed 0: every loss
    finite and the mean of the last 5 steps below the mean of the first 5. Plus qwen3-0.6b from
    a local folder with weights (--path): its first-step loss is the single-process loss of
    those weights. Cards with the same tiny run share it (module docstring)."""
    cards = trainable_cards()
    run_of: dict[str, int] = {}  # card id -> index of the run that trains its tiny config
    cfgs, keys = [], []
    for card in cards:
        job = {"steps": STEPS, "out_dir": str(tmp_path / card.id), "data": SMALL}
        options = TrainOptions(tiny=True, job=job)
        model = write_tiny_config(card, tmp_path / card.id / "model")
        cfg = train_config(card, options, model)
        key = (model.read_text(), _without_paths(cfg))
        if key not in keys:
            keys.append(key)
            cfgs.append(cfg)
        run_of[card.id] = keys.index(key)
    saved = tmp_path / "saved-qwen3"
    card = registry.get("qwen3-0.6b")
    torch.manual_seed(5)
    config = transformers.AutoConfig.from_pretrained(write_tiny_config(card, saved).parent)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    options = TrainOptions(
        path=saved, job={"steps": 2, "out_dir": str(tmp_path / "from-path"), "data": SMALL}
    )
    cfgs.append(train_config(card, options, saved))
    assert cfgs[-1].hf.load_weights

    losses = launch(_train_all, 2, cfgs, timeout=1200)[0]
    for card in cards:
        run, out = losses[run_of[card.id]], Path(cfgs[run_of[card.id]].out_dir)
        assert len(run) == STEPS and all(math.isfinite(x) for x in run), card.id
        assert sum(run[-5:]) / 5 < sum(run[:5]) / 5, (card.id, run)
        assert (out / "checkpoints" / "latest").read_text() == "step_0000020", card.id
    assert abs(losses[-1][0] - _reference_first_loss(cfgs[-1], saved)) < 1e-4


@pytest.mark.distributed
def test_train_command_end_to_end(tmp_path: Path):
    """The command end to end, given a setting of the train job's own data section; the
    tiny model is recorded as the run's, and a second run into the folder is refused."""
    out = tmp_path / "run"
    args = ["train", "qwen3-30b-a3b-instruct-2507", "--tiny", "--steps", "4", "--out-dir"]
    small = ["--set", "data.max_bytes=200000", "--set", "data.seq_len=32"]
    sections = ["--set", "data.global_batch_size=8"]
    result = CliRunner().invoke(app, [*args, str(out), *small, *sections])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["card"] == "qwen3-30b-a3b-instruct-2507" and summary["steps"] == [0, 4]
    assert len(summary["losses"]) == 4 and all(math.isfinite(x) for x in summary["losses"])
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_hidden_layers"] == 2
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["loss"] for r in metrics["train"]] == summary["losses"]
    assert metrics["config"]["data"]["global_batch_size"] == 8
    assert (out / "loss.png").exists() and (out / "checkpoints" / "latest").exists()
    assert "model" in RunRecord(out).recorded()  # --overwrite replaces it with the run
    again = CliRunner().invoke(app, [*args, str(out), *small])
    assert again.exit_code == 2 and "already holds a run" in again.stderr, again.output
    assert json.loads((out / "metrics.json").read_text()) == metrics


def test_only_full_llm_cards_train():
    with pytest.raises(InputError, match=r"flux\.1-dev is a image-generation card; .*qwen3-0\.6b"):
        check_trainable(registry.get("flux.1-dev"))
    listed = next(c for c in registry.list("llm", "listed"))
    with pytest.raises(InputError, match=f"{listed.id} is a listed card"):
        check_trainable(listed)


JOB_ITEMS = [
    "data.global_batch_size=8",
    "optim.muon_lr=0.01",
    "activation.policy='recompute'",
    "parallel.timeout_s=30.0",
]


def test_cli_takes_the_train_jobs_sections_as_hyperparallel_does(monkeypatch, tmp_path: Path):
    """--config and --set reach TrainConfig's sections unchanged (hyperparallel's own parse of
    the same items is the reference), shortcut options win over them, and the card run's
    defaults fill the rest. No rank starts: the run itself is replaced."""
    from hyperparallel.train.config import TrainConfig

    given: dict = {}

    def prepare(card, options, **_):
        given["o"] = options
        return SimpleNamespace(out_dir=tmp_path / "run")

    monkeypatch.setattr("torchmind_modelzoo.training.prepare", prepare)
    monkeypatch.setattr("torchmind_modelzoo.training.start", lambda run, **_: {})
    toml = tmp_path / "run.toml"
    toml.write_text("[optim]\nadamw_lr = 0.001\n[data]\nseq_len = 48\n")
    items = [arg for item in JOB_ITEMS for arg in ("--set", item)]
    argv = ["train", "qwen3-0.6b", "--tiny", "--config", str(toml), *items, "--seq-len", "32"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    cfg = train_config(registry.get("qwen3-0.6b"), given["o"], tmp_path / "config.json")
    reference = TrainConfig.load(None, toml, [*JOB_ITEMS, "data.seq_len=32"])
    assert cfg.activation == reference.activation
    assert cfg.optim.model_dump(exclude={"warmup_steps"}) == reference.optim.model_dump(
        exclude={"warmup_steps"}
    )
    assert cfg.data.global_batch_size == 8 and cfg.data.seq_len == 32  # --seq-len over TOML
    assert cfg.parallel.timeout_s == 30.0 and cfg.parallel.nproc == 2  # --set, card default
    assert cfg.optim.warmup_steps == 2 and cfg.steps == cfg.eval_every == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flux.1-dev", "--tiny"], "modelzoo train takes the full LLM cards: deepseek-v3-0324"),
        (["qwen3-0.6b"], "give --tiny (random weights, offline) or --path DIR"),
        (["qwen3-0.6b", "--tiny", "--path", "{tmp}"], "give --tiny or --path, not both"),
        (["qwen3-0.6b", "--path", "{tmp}/missing"], "does not exist"),
        (["qwen3-0.6b", "--tiny", "--mesh", "pp=3"], "pp=3 = 3 ranks != world size 2"),
        (
            ["qwen3-0.6b", "--tiny", "--seq-len", "256"],
            "data.seq_len=256 exceeds max_position_embeddings=128",
        ),
        (["qwen3-0.6b", "--tiny", "--data", "{tmp}/none.txt"], "no such file or folder"),
        (
            ["qwen3-0.6b", "--tiny", "--set", "data.global_batchsize=8"],
            "data.global_batchsize: Extra inputs are not permitted (got 8), choose one of path, "
            "max_bytes, seq_len, batch_size, global_batch_size, val_fraction",
        ),
        (
            ["qwen3-0.6b", "--tiny", "--set", "data.global_batch_size=0"],
            "data.global_batch_size: Input should be greater than or equal to 1 (got 0)",
        ),
        (["qwen3-0.6b", "--tiny", "--set", "hf.source=x"], "leave hf.source and hf.load_weights"),
        (["qwen3-0.6b", "--tiny", "--set", "steps"], "expected key=value or section.key=value"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_ranks(
    args: list[str], message: str, tmp_path: Path
):
    out = tmp_path / "out"
    argv = ["train", *(a.format(tmp=tmp_path) for a in args), "--out-dir", str(out)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]
    assert not out.exists()
