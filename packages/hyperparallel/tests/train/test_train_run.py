"""`hyperparallel train` end to end on real gloo ranks: loss falls, resume is exact (faults:
`test_failure_behaviour.py`)."""

from __future__ import annotations

import json

import pytest

from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.dist import launch

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
