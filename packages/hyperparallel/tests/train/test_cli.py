"""The `hyperparallel train` command line: a tiny run, and the same under torchrun (refusals:
`test_failure_behaviour.py`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hyperparallel.cli import app


@pytest.mark.distributed
def test_tiny_training_run_through_the_cli(tmp_path):
    """The CLI spawns ranks, trains with a swap/recompute block policy, reports the loss and
    the saved-activation bytes, and writes metrics, the plot and the asked-for step traces."""
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--preset",
            "debug",
            "--nproc",
            "2",
            "--steps",
            "6",
            "--mesh",
            "fsdp",
            "--out-dir",
            str(tmp_path),
            "--activation",
            "selective_swap",
            "--swap-inputs",
            "--set",
            "activation.swap_threshold_bytes=0",
            "--profile-steps",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "steps 0->6: loss" in result.output
    report = " ".join(result.output.split())
    assert "saved activations per step (rank 0, 1 checkpointed blocks): device" in report
    metrics = json.loads((tmp_path / "metrics.json").read_text())["train"][-1]
    assert metrics["saved_host_mb"] > 0 and metrics["saved_recomputed_mb"] > 0
    assert len(json.loads((tmp_path / "metrics.json").read_text())["train"]) == 6
    assert (tmp_path / "loss.png").exists()
    traces = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert traces == ["rank0_step2.json", "rank1_step2.json"]
    events = json.loads((tmp_path / "profile" / "rank1_step2.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert "train_step_2" in names and "aten::mm" in names  # the step's marker and its GEMMs


@pytest.mark.distributed
def test_same_command_runs_under_torchrun(tmp_path):
    """Under torchrun each process is one rank (mccl joins the elastic agent's store)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "hyperparallel.cli",
        "train",
        "--preset",
        "debug",
        "--steps",
        "3",
        "--out-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("steps 0->3: loss") == 1  # rank 0 alone reports
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000003"
