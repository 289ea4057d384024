"""Faults and bad input to ``hyperparallel train``: what the user sees, and that nothing is lost.

Every case asserts the exit code, the one-line message and that no file was written or lost.
Refusals happen before any rank starts; faults during a run (a killed rank, a signal, a damaged
checkpoint) stop every rank and leave the last complete checkpoint resumable. The README's
"Failure behaviour" section is written from this module and ``test_rank_failures.py`` (a rank's
failure as one line). Related unit tests: manifests and fall-back in
``test_checkpoint_integrity.py``, the out-dir rules in ``test_out_dir.py``, the launcher's own
signal handling in npu-core's ``test_launch.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hyperparallel.cli import app, main
from hyperparallel.data.stdlib_bytes import read_corpus
from hyperparallel.train import checkpoint, job
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.dist import RankExitedError, launch


def _invoke(*args: str):
    return CliRunner().invoke(app, ["train", "--preset", "debug", "--nproc", "2", *args])


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def _text_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("plain text for training. " * 400)
    return folder


def _binary_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 40)  # a zip's header, NULs
    return path


# (case id, extra arguments (``{tmp}`` is the test's folder), expected one-line message)
REFUSED = [
    ("unknown preset", ["--preset", "huge"], "--preset 'huge': unknown; choose one of"),
    ("bad model shape", ["--set", "model.n_heads=3"], "model: n_heads=3 must divide dim=32"),
    ("unknown key", ["--set", "optim.lr=1"], "optim.lr: Extra inputs are not permitted"),
    ("zero steps", ["--steps", "0"], "steps: Input should be greater than or equal to 1"),
    ("mesh vs world", ["--mesh", "3x3"], "3 x 3 ranks != world size 2"),
    ("unknown mesh dim", ["--mesh", "tp=2"], "'tp=2' is not dim=size; use 'fsdp', 'RxS'"),
    ("mesh product", ["--mesh", "pp=2,ep=2"], "pp=2 x ep=2 = 4 ranks != world size 2"),
    ("pp without blocks", ["--mesh", "pp=2"], "model.n_layers=1 is fewer than the 2 pipeline"),
    (
        "bad microbatches",
        ["--mesh", "pp=2", "--microbatches", "3", "--set", "model.n_layers=2"],
        "parallel.microbatches=3 must divide the 4 samples",
    ),
    ("unknown pp schedule", ["--pp-schedule", "zbv"], "parallel.pp_schedule: Input should be"),
    (
        "bool as int",
        ["--set", "data.batch_size=true"],
        "data.batch_size: a boolean is not a number (got True)",
    ),
    (
        "bool as float",
        ["--set", "optim.muon_lr=false"],
        "optim.muon_lr: a boolean is not a number (got False)",
    ),
    ("nan lr", ["--set", "optim.muon_lr=nan"], "optim.muon_lr: Input should be a finite number"),
    ("negative timeout", ["--timeout", "-1"], "parallel.timeout_s: Input should be greater than 0"),
    ("infinite timeout", ["--timeout", "inf"], "parallel.timeout_s: Input should be a finite"),
    (
        "seq_len above the model's",
        ["--set", "data.seq_len=64"],
        "data.seq_len=64 exceeds model.max_seq_len=32",
    ),
    (
        "per-block list too long",
        ["--set", "activation.per_block=['save','save']"],
        "activation.per_block lists 2 policies but model.n_layers=1",
    ),
    ("missing data", ["--data", "{tmp}/nope"], "--data {tmp}/nope: no such file or folder"),
    ("empty data file", ["--data", "{tmp}/empty.txt"], "only 0 bytes of text found"),
    ("data folder without text", ["--data", "{tmp}/emptydir"], "only 0 bytes of text found"),
    ("binary data file", ["--data", "{tmp}/blob.bin"], "a binary file (NUL byte at offset 4)"),
    ("missing config", ["--config", "{tmp}/nope.toml"], "--config {tmp}/nope.toml: no such file"),
    ("binary config", ["--config", "{tmp}/blob.bin"], "not valid TOML"),
    ("resume without checkpoint", ["--resume"], "--resume: no checkpoint under"),
    ("resume and overwrite", ["--resume", "--overwrite"], "exclude each other"),
    ("out-dir below a file", ["--out-dir", "{tmp}/empty.txt/run"], "cannot be created"),
    (
        "model too large for the machine",
        ["--set", "model.dim=1048576"],
        "the built-in MoE (model.dim=1048576, model.n_layers=1, model.n_experts=4, "
        "model.ffn_dim=32, model.vocab_size=256) has 4,398,993,375,232 parameters; 2 ranks each "
        "build it whole in fp32 at start-up, at least 32,775.1 GiB, above this machine's",
    ),
    (
        "vocabulary below the bytes",
        ["--set", "model.vocab_size=10"],
        "model.vocab_size=10 is below the byte vocabulary: the data holds byte value",
    ),
    (
        "tokenizer without --model",
        ["--tokenizer", "{tmp}"],
        "--tokenizer applies only to a transformers model, and no --model (hf.source) is given",
    ),
    (
        "hf.overrides without --model",
        ["--set", "hf.overrides={num_hidden_layers=2}"],
        "hf.overrides applies only to a transformers model",
    ),
    (
        "config change flag without --resume",
        ["--allow-config-change"],
        "applies only with --resume",
    ),
]


@pytest.mark.parametrize(("args", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_input_is_refused_before_ranks_start(tmp_path, snapshot, args, message):
    """Exit 2, one ``error:`` line naming the argument, the value and what is allowed; no
    traceback, and the folder the run would write to is neither created nor changed."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    _binary_file(tmp_path / "blob.bin")
    before = snapshot(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out-dir" not in args:
        args += ["--out-dir", str(tmp_path / "run")]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = _lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "run").exists()


def _set_config(folder: Path, **fields) -> None:
    """Change fields of the folder's config.json after its weights were saved."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _shard_the_weights(folder: Path) -> None:
    """An index naming two shards, of which only the first is in the folder."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors"}
    weight_map["b.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


PER_BLOCK = 21
"""Tensors of one saved tiny Qwen3-MoE block: q, k, v, o, q_norm, k_norm, its two norms, the
router, and gate, up and down of each of the 4 experts."""

# (case id, how the saved model's folder is changed, expected one-line message)
BAD_WEIGHTS = [
    (
        "other vocabulary",
        lambda folder: _set_config(folder, vocab_size=96),
        "do not fit its config.json: 2 tensor(s) of another shape (lm_head.weight: [64, 32] "
        "in model.safetensors, [96, 32] from config.json; model.embed_tokens.weight: [64, 32] "
        "in model.safetensors, [96, 32] from config.json)",
    ),
    (
        "more layers in the config",
        lambda folder: _set_config(folder, num_hidden_layers=3),
        f"do not fit its config.json: {PER_BLOCK} missing (model.layers.2.",
    ),
    (
        "fewer layers in the config",
        lambda folder: _set_config(folder, num_hidden_layers=1),
        f"do not fit its config.json: {PER_BLOCK} not in the model (model.layers.1.",
    ),
    (
        "weights of another name only",
        lambda folder: (folder / "model.safetensors").rename(folder / "adapter.safetensors"),
        "holds none of model.safetensors, model.safetensors.index.json, pytorch_model.bin",
    ),
    (
        "damaged header",
        lambda folder: (folder / "model.safetensors").write_bytes(b"\xff" * 64),
        "model.safetensors is not a safetensors file (header length 18446744073709551615 past",
    ),
    (
        "missing shard",
        _shard_the_weights,
        "model.safetensors.index.json names 1 shard(s) the folder does not hold: "
        "model-00002-of-00002.safetensors",
    ),
]


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE saved by ``save_pretrained`` (per-expert tensors in the file, fused
    stacks in the model): config.json and model.safetensors."""
    import torch
    import transformers

    from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE

    folder = tmp_path_factory.mktemp("saved-moe")
    config = transformers.Qwen3MoeConfig(**TINY_HF_SHAPE, **QWEN3_MOE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("change", "message"), [c[1:] for c in BAD_WEIGHTS], ids=[c[0] for c in BAD_WEIGHTS]
)
def test_weights_that_do_not_fit_the_config_are_refused_before_ranks_start(
    tmp_path, snapshot, saved_moe, change, message
):
    """``--model`` a folder whose weight files do not fit its config.json (from_pretrained would
    start the missing parameters random, or fail in every rank): exit 2, one line naming the
    folder and the tensors, and nothing written; the unchanged folder passes the same check."""
    folder = tmp_path / "model"
    shutil.copytree(saved_moe, folder)
    assert job.check(_cfg(tmp_path / "run", f"hf.source={str(folder)!r}")) == []
    change(folder)
    before = snapshot(tmp_path)
    result = _invoke("--model", str(folder), "--out-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    (line,) = _lines(result)
    assert line.startswith("error: --load-weights: ") and str(folder) in line, line
    assert message in line, line
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "ten"], "Invalid value for '--steps': 'ten': Input should be a valid integer"),
        (["--nproc", "2.5"], "Invalid value for '--nproc': '2.5': Input should be a valid"),
        (["--step", "3"], "No such option: --step"),
    ],
)
def test_console_script_refuses_unparsable_options_in_one_line(
    tmp_path, monkeypatch, capsys, args, message
):
    """`hyperparallel` itself (main), where click refuses before the config: one line, exit 2."""
    argv = ["hyperparallel", "train", "--preset", "debug", *args, "--out-dir", str(tmp_path / "r")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags", [[], ["--resume", "--overwrite"]], ids=["no flag", "both"])
def test_an_earlier_run_is_never_mixed_into(tmp_path, earlier_run, snapshot, flags):
    """A folder holding a run is refused without --resume / --overwrite; files are unchanged."""
    before = earlier_run(tmp_path)
    result = _invoke("--out-dir", str(tmp_path), *flags)
    assert result.exit_code == 2
    assert len(_lines(result)) == 1
    expected = "exclude each other" if flags else "already holds a run (metrics.json, checkpoints)"
    assert expected in result.output
    assert snapshot(tmp_path) == before


def test_binary_file_inside_a_data_folder_is_skipped_with_one_warning(tmp_path, earlier_run):
    """A folder's binary file is named in one warning line (before the next check refuses the
    occupied out-dir here); the corpus holds only the text files."""
    data = _text_folder(tmp_path / "data")
    blob = _binary_file(data / "image.json")
    earlier_run(tmp_path / "out")
    result = _invoke("--data", str(data), "--out-dir", str(tmp_path / "out"))
    assert result.exit_code == 2
    warning, error = _lines(result)
    assert warning == f"warning: --data {data}: skipped 1 binary file(s): {blob}"
    assert error.startswith("error: --out-dir")
    with pytest.warns(RuntimeWarning, match="skipped 1 binary file"):
        assert read_corpus(data) == (data / "a.txt").read_bytes()


def test_a_checkpoints_symlink_is_refused_not_followed(tmp_path, snapshot):
    """An out-dir whose ``checkpoints`` is a symlink the job did not create: --overwrite is one
    line, exit 2, and neither the link nor its target changes (was: an rmtree traceback)."""
    target = _text_folder(tmp_path / "elsewhere")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(target)
    before = snapshot(target)
    result = _invoke("--out-dir", str(run), "--overwrite")
    assert result.exit_code == 2, result.output
    (line,) = _lines(result)
    assert line.startswith(f"error: --out-dir {run} holds checkpoints, which no recorded run")
    assert (run / "checkpoints").is_symlink() and snapshot(target) == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def _finished_run(folder: Path, cfg) -> None:
    """A run's folder as the job leaves it: its record, a checkpoint, metrics with its config."""
    from hyperparallel.train.metrics import MetricsLog
    from npu_core.run_record import RunRecord

    RunRecord(folder).claim(["metrics.json", "loss.png", "checkpoints", "logs"])
    step = folder / "checkpoints" / "step_0000005"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"\1" * 64)
    checkpoint._write_manifest(step)
    MetricsLog().write(folder / "metrics.json", cfg.model_dump())


def test_resume_with_changed_model_or_data_settings_is_refused(tmp_path, snapshot):
    """--resume with other attention heads (the same tensor shapes) or other windows: one line
    naming each changed field, before any rank starts and with nothing written."""
    _finished_run(tmp_path, _cfg(tmp_path))
    before = snapshot(tmp_path)
    result = _invoke(
        "--out-dir", str(tmp_path), "--resume", "--set", "model.n_heads=4", "--steps", "30"
    )
    assert result.exit_code == 2, result.output
    (line,) = _lines(result)
    assert "changes the model or data settings" in line
    assert "model.n_heads 2 -> 4" in line and "--allow-config-change" in line
    assert snapshot(tmp_path) == before


def test_resume_in_another_dtype_is_refused(tmp_path):
    """The parameters' dtype is a model setting: an fp32 run resumed with ``dtype=bf16`` is
    refused, naming it, unless the change is intended."""
    _finished_run(tmp_path, _cfg(tmp_path))
    changed = _cfg(tmp_path, "dtype='bf16'", "steps=40")
    with pytest.raises(ValueError, match=r"dtype 'fp32' -> 'bf16'; restore them"):
        job.check(changed, resume=True)
    assert job.check(changed, resume=True, allow_config_change=True) == [
        "--resume with changed model or data settings (--allow-config-change): "
        "dtype 'fp32' -> 'bf16'"
    ]


def test_an_intended_config_change_is_accepted_with_a_warning(tmp_path):
    """--allow-config-change lets the resume through and names the changes; the schedule and
    the layout may change without it."""
    _finished_run(tmp_path, _cfg(tmp_path))
    changed = _cfg(tmp_path, "data.seq_len=16", "steps=40", "optim.muon_lr=0.01")
    with pytest.raises(ValueError, match=r"data.seq_len 32 -> 16; restore them"):
        job.check(changed, resume=True)
    assert job.check(changed, resume=True, allow_config_change=True) == [
        "--resume with changed model or data settings (--allow-config-change): "
        "data.seq_len 32 -> 16"
    ]
    assert job.check(_cfg(tmp_path, "steps=40", "parallel.mesh='2x2'"), resume=True) == []


def test_warm_up_longer_than_the_run_is_a_warning_line(tmp_path, earlier_run):
    """A learning rate that never reaches its setting is named in one warning line (here before
    the occupied out-dir is refused, so that no rank starts)."""
    earlier_run(tmp_path)
    result = _invoke("--out-dir", str(tmp_path), "--set", "optim.warmup_steps=1000")
    warning, error = _lines(result)
    assert warning == (
        "warning: optim.warmup_steps=1000 is above steps=20: the learning rates rise to 2% of "
        "their settings at the last step and never decay; lower optim.warmup_steps"
    )
    assert error.startswith("error: --out-dir")


@pytest.mark.distributed
def test_overwrite_keeps_a_users_folder_the_run_also_names(tmp_path):
    """The issue's case: an out-dir holding the user's ``profile/me.txt`` is no earlier run and,
    with --overwrite as well, the run trains and the user's file is still there."""
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "me.txt").write_text("mine")
    result = _invoke("--out-dir", str(tmp_path), "--overwrite", "--steps", "2")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "profile" / "me.txt").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000002"


# ---- faults during a run (real gloo ranks) ------------------------------------------------------


def _cfg(tmp_path, *overrides):
    return load_config(debug(), overrides=[f"out_dir={str(tmp_path)!r}", *overrides])


def _train_then_die(cfg, die_at_step: int):
    from hyperparallel.data.stdlib_bytes import ByteBatches

    original = ByteBatches.train_batch

    def train_batch(self, step, *args, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == 1 and step == die_at_step:
            os._exit(9)  # a rank lost mid-run (OOM killer, node failure)
        return original(self, step, *args, **kwargs)

    ByteBatches.train_batch = train_batch
    return train_rank(cfg, False)


@pytest.mark.distributed
def test_killed_rank_stops_the_run_and_resume_uses_last_checkpoint(tmp_path):
    """A rank dying mid-run fails the job promptly naming it; resume restarts from the last
    checkpoint."""
    cfg = _cfg(tmp_path, "checkpoint_every=5", "parallel.timeout_s=30")
    with pytest.raises(RankExitedError, match="rank 1 exited with code 9"):
        launch(_train_then_die, 2, cfg, 12, backend=None, timeout=120)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000010"
    resumed = launch(train_rank, 2, cfg, True, backend=None, timeout=300)[0]
    assert resumed.first_step == 10


@pytest.mark.distributed
def test_damaged_latest_checkpoint_resumes_from_the_previous_one(tmp_path, capfd):
    """A truncated shard in the newest checkpoint: the CLI's resume names it in one warning
    line (not a Python warning from a rank), starts from the one before and then reproduces
    the uninterrupted run's losses exactly."""
    full = launch(
        train_rank, 2, _cfg(tmp_path / "full", "steps=12"), False, backend=None, timeout=300
    )
    part = _cfg(tmp_path / "part", "steps=10", "checkpoint_every=5")
    launch(train_rank, 2, part, False, backend=None, timeout=300)
    shard = next((tmp_path / "part" / "checkpoints" / "step_0000010").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    capfd.readouterr()
    result = _invoke("--out-dir", str(tmp_path / "part"), "--resume", "--steps", "12")
    assert result.exit_code == 0, result.output
    warning = next(line for line in _lines(result) if line.startswith("warning: resuming"))
    assert warning.startswith(
        "warning: resuming from step_0000005; skipped newer damaged checkpoints: step_0000010: "
    )
    assert "has 100 bytes" in warning
    assert "RuntimeWarning" not in result.output + capfd.readouterr().err
    metrics = json.loads((tmp_path / "part" / "metrics.json").read_text())["train"]
    assert [r["step"] for r in metrics] == list(range(1, 13))
    assert [r["loss"] for r in metrics[5:]] == full[0].train_losses[5:]


@pytest.mark.distributed
def test_only_damaged_checkpoints_is_one_line_and_exit_2(tmp_path, snapshot):
    """The CLI names each damaged checkpoint in one error line instead of a rank traceback."""
    folder = tmp_path / "checkpoints" / "step_0000005"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"\1" * 64)
    checkpoint._write_manifest(folder)
    (folder / "__0_0.distcp").write_bytes(b"\1" * 10)
    before = snapshot(tmp_path)
    result = _invoke("--out-dir", str(tmp_path), "--resume")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "error: no checkpoint under" in text and "step_0000005" in text
    assert "has 10 bytes, 64 were written" in text
    assert "Traceback" not in result.output
    assert snapshot(tmp_path) == before


@pytest.mark.distributed
def test_resume_with_nothing_left_to_train_says_so(tmp_path):
    """--resume with steps at or below the checkpoint's step is an error, not a silent exit."""
    launch(train_rank, 2, _cfg(tmp_path, "steps=5"), False, backend=None, timeout=300)
    with pytest.raises(
        checkpoint.CheckpointError, match="is at step 5, and steps=5 leaves nothing to train"
    ):
        launch(train_rank, 2, _cfg(tmp_path, "steps=5"), True, backend=None, timeout=300)


@pytest.mark.distributed
def test_resume_with_a_changed_model_names_the_mismatch(tmp_path):
    """A checkpoint of another model shape is refused as such, not with a DCP size traceback."""
    launch(train_rank, 2, _cfg(tmp_path, "steps=3"), False, backend=None, timeout=300)
    wider = _cfg(tmp_path, "steps=6", "model.ffn_dim=96")
    with pytest.raises(checkpoint.CheckpointError, match="does not fit this model"):
        launch(train_rank, 2, wider, True, backend=None, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_signal_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, process_tree, signame):
    """SIGTERM or kill -9 of the training CLI once training is under way: no rank, forkserver
    or resource tracker is left running (SIGTERM: exit 128 + signal; SIGKILL leaves the CLI no
    cleanup, the ranks notice its death themselves), the run stops advancing, and the newest
    checkpoint written before the signal is intact. SIGHUP takes SIGTERM's handler in
    npu-core's launcher, which tests it on its own ranks (``test_launch.py``)."""
    command = [sys.executable, "-m", "hyperparallel.cli", "train", "--preset", "debug"]
    command += ["--nproc", "2", "--steps", "2000", "--set", "checkpoint_every=1"]
    command += ["--out-dir", str(tmp_path)]
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "checkpoints" / "latest").exists():  # the first step is done
            assert parent.poll() is None, f"train exited early with {parent.returncode}"
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.2)
        processes = process_tree.descendants(parent.pid)
        assert len(processes) >= 3  # forkserver and two ranks
        signum = getattr(signal, signame)
        parent.send_signal(signum)
        expected = -signum if signum == signal.SIGKILL else 128 + signum
        assert parent.wait(timeout=30) == expected
    finally:
        if parent.poll() is None:
            parent.kill()
    deadline = time.monotonic() + 10
    while any(process_tree.alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in processes if process_tree.alive(pid)], "processes outlived the CLI"
    stopped_at = (tmp_path / "checkpoints" / "latest").read_text()
    time.sleep(1.0)
    assert (tmp_path / "checkpoints" / "latest").read_text() == stopped_at
    newest = checkpoint.latest(tmp_path / "checkpoints")
    assert newest is not None and checkpoint.verify(newest) is None
