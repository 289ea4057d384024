"""`hyperparallel train` end to end on real gloo ranks: loss falls, resume is exact, faults stop."""

from __future__ import annotations

import json
import os

import pytest

from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.dist import RankExitedError, launch

pytestmark = pytest.mark.distributed


def _cfg(tmp_path, *overrides):
    return load_config(debug(), overrides=[f"out_dir={str(tmp_path)!r}", *overrides])


def test_short_run_loss_falls_and_writes_outputs(tmp_path):
    """Two FSDP ranks, 30 steps: training and validation loss fall; plot, metrics, checkpoint."""
    cfg = _cfg(tmp_path, "steps=30", "eval_every=15")
    first, second = launch(train_rank, 2, cfg, False, backend=None, timeout=300)
    assert first.train_losses == second.train_losses  # all-reduced mean, same on every rank
    assert first.train_losses[-1] < first.train_losses[0] - 0.5
    assert first.val_losses[-1] < first.val_losses[0]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["step"] for r in metrics["train"]] == list(range(1, 31))
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000030"


def test_resume_continues_with_identical_losses(tmp_path):
    """Stopping at step 10 and resuming reproduces the uninterrupted run's losses exactly."""
    full = launch(train_rank, 2, _cfg(tmp_path / "full"), False, backend=None, timeout=300)[0]
    part = _cfg(tmp_path / "part", "steps=10")
    launch(train_rank, 2, part, False, backend=None, timeout=300)
    rest = launch(train_rank, 2, _cfg(tmp_path / "part"), True, backend=None, timeout=300)[0]
    assert rest.first_step == 10
    assert rest.train_losses == full.train_losses[10:]


def test_hsdp_mesh_trains(tmp_path):
    """A 2 x 2 HSDP mesh trains and matches the FSDP run's first-step loss (same init, data)."""
    hsdp = launch(
        train_rank,
        4,
        _cfg(tmp_path / "h", "parallel.mesh='2x2'", "steps=6"),
        False,
        backend=None,
        timeout=300,
    )[0]
    fsdp = launch(train_rank, 4, _cfg(tmp_path / "f", "steps=6"), False, backend=None, timeout=300)[
        0
    ]
    assert hsdp.train_losses[0] == pytest.approx(fsdp.train_losses[0], rel=1e-5)
    assert hsdp.train_losses[-1] < hsdp.train_losses[0]


def _train_then_die(cfg, die_at_step: int):
    from hyperparallel.data.stdlib_bytes import ByteBatches

    original = ByteBatches.train_batch

    def train_batch(self, step, rank, batch):
        if rank == 1 and step == die_at_step:
            os._exit(9)  # a rank lost mid-run (OOM killer, node failure)
        return original(self, step, rank, batch)

    ByteBatches.train_batch = train_batch
    return train_rank(cfg, False)


def test_killed_rank_stops_the_run_and_resume_uses_last_checkpoint(tmp_path):
    """A rank dying mid-run fails the job promptly; resume restarts from the last checkpoint."""
    cfg = _cfg(tmp_path, "checkpoint_every=5", "parallel.timeout_s=30")
    with pytest.raises(RankExitedError, match="rank 1 exited with code 9"):
        launch(_train_then_die, 2, cfg, 12, backend=None, timeout=120)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000010"
    resumed = launch(train_rank, 2, cfg, True, backend=None, timeout=300)[0]
    assert resumed.first_step == 10


def test_damaged_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    """A truncated shard in the newest checkpoint: resume starts from the one before and then
    reproduces the uninterrupted run's losses exactly."""
    full = launch(
        train_rank, 2, _cfg(tmp_path / "full", "steps=12"), False, backend=None, timeout=300
    )
    part = _cfg(tmp_path / "part", "steps=10", "checkpoint_every=5")
    launch(train_rank, 2, part, False, backend=None, timeout=300)
    shard = next((tmp_path / "part" / "checkpoints" / "step_0000010").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    rest = launch(
        train_rank, 2, _cfg(tmp_path / "part", "steps=12"), True, backend=None, timeout=300
    )
    assert rest[0].first_step == 5
    assert rest[0].train_losses == full[0].train_losses[5:]


def test_resume_with_nothing_left_to_train_says_so(tmp_path):
    """--resume with steps at or below the checkpoint's step is an error, not a silent exit."""
    from hyperparallel.train.checkpoint import CheckpointError

    launch(train_rank, 2, _cfg(tmp_path, "steps=5"), False, backend=None, timeout=300)
    with pytest.raises(CheckpointError, match="is at step 5, and steps=5 leaves nothing to train"):
        launch(train_rank, 2, _cfg(tmp_path, "steps=5"), True, backend=None, timeout=300)


def test_resume_with_a_changed_model_names_the_mismatch(tmp_path):
    """A checkpoint of another model shape is refused as such, not with a DCP size traceback."""
    from hyperparallel.train.checkpoint import CheckpointError

    launch(train_rank, 2, _cfg(tmp_path, "steps=3"), False, backend=None, timeout=300)
    wider = _cfg(tmp_path, "steps=6", "model.ffn_dim=96")
    with pytest.raises(CheckpointError, match="does not fit this model"):
        launch(train_rank, 2, wider, True, backend=None, timeout=300)
