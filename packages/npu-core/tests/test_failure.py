"""npu_core.dist.failure and npu_core.cli.rank_failures: one line per failed rank."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest
import torch.distributed as dist
import typer
from typer.testing import CliRunner

from npu_core.cli import rank_failures
from npu_core.dist import RankStoppedError, launch
from npu_core.dist.failure import describe

pytestmark = pytest.mark.distributed


def _rank_one_runs_out_of_memory() -> None:
    if dist.get_rank() == 1:
        raise MemoryError("cannot hold 8 TiB of activations")
    dist.barrier()


def _rank_one_fills_the_disk(path: str) -> None:
    if dist.get_rank() == 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    dist.barrier()


def _rank_one_is_killed() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _rank_one_stops() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def _rank_one_indexes_past_the_end() -> None:
    if dist.get_rank() == 1:
        [0, 1][10]
    dist.barrier()


def _failure_of(fn, *args, timeout: float = 60):
    with pytest.raises(Exception) as info:  # noqa: PT011 - every kind of failure is under test
        launch(fn, 2, *args, timeout=timeout)
    return describe(info.value)


def test_out_of_memory_names_the_rank_and_the_cause():
    failure = _failure_of(_rank_one_runs_out_of_memory)
    assert failure.rank == 1
    assert failure.cause == "out of memory (cannot hold 8 TiB of activations)"
    assert "_rank_one_runs_out_of_memory" in failure.details  # the rank's own traceback


def test_full_disk_names_the_file(tmp_path):
    target = str(tmp_path / "step_10" / "shard.distcp")
    failure = _failure_of(_rank_one_fills_the_disk, target)
    assert failure.line() == f"rank 1: no space left on the device: {target}"


def test_killed_rank_names_the_signal():
    failure = _failure_of(_rank_one_is_killed)
    assert failure.rank == 1
    assert failure.cause.startswith("killed by SIGKILL")


def test_stopped_rank_is_named_instead_of_the_peer_that_timed_out():
    with pytest.raises(RankStoppedError) as info:
        launch(_rank_one_stops, 2, timeout=6)
    failure = describe(info.value)
    assert failure.rank == 1
    assert failure.cause.startswith("stopped")


def test_rank_failures_prints_one_line_and_keeps_the_traceback(tmp_path):
    app = typer.Typer()

    @app.command()
    def train() -> None:
        with rank_failures(tmp_path / "logs"):
            launch(_rank_one_indexes_past_the_end, 2, timeout=60)

    result = CliRunner().invoke(app, [])
    log = tmp_path / "logs" / "rank1.log"
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: rank 1: IndexError: list index out of range (traceback in {log})"
    ]
    assert "_rank_one_indexes_past_the_end" in log.read_text()


def test_rank_failures_leaves_refusals_alone(tmp_path):
    app = typer.Typer()

    @app.command()
    def train() -> None:
        with rank_failures(tmp_path / "logs"):
            raise typer.Exit(2)

    assert CliRunner().invoke(app, []).exit_code == 2
    assert not (tmp_path / "logs").exists()
