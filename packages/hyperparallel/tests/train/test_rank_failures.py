"""Faults inside the ranks of ``hyperparallel train``: each ends the job with one ``error:`` line
that names the rank and the cause and points to the log holding the traceback; nothing is left
running, and a failed checkpoint leaves no half-written folder.

The refusals before any rank starts are in ``test_failure_behaviour.py``.
"""

from __future__ import annotations

import errno
import io
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import typer

from hyperparallel.train import checkpoint
from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.cli import rank_failures
from npu_core.dist import find_free_port, launch

TRAIN = [sys.executable, "-m", "hyperparallel.cli", "train", "--preset", "debug"]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.distributed
def test_a_rank_that_never_starts_is_waited_for_visibly_until_the_timeout(tmp_path):
    """torchrun-style start with rank 1 never started: rank 0 says what it waits for, honours
    --timeout (not mccl's default 300 s) and ends with one error line naming the absent rank."""
    port = find_free_port()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("MCCL_INIT_TIMEOUT", None)
    command = [*TRAIN, "--timeout", "6", "--out-dir", str(tmp_path)]
    began = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert f"waiting for 1 more rank at 127.0.0.1:{port} (timeout 6 s)" in done.stderr
    (line,) = _error_lines(done.stderr)
    log = tmp_path / "logs" / "rank0.log"
    assert line == (
        f"error: rank 0: InitTimeoutError: ranks [1] of 2 never arrived at the rendezvous store "
        f"127.0.0.1:{port} within 6 s (seen from rank 0); check that every rank was started and "
        f"can reach that address (traceback in {log})"
    )
    assert "Traceback" not in done.stderr and "Traceback" in log.read_text()
    assert took < 100  # the 6 s limit and start-up, far from mccl's 300 s default


def _ranks(process_tree, cli: int) -> list[int]:
    """The ranks below the CLI: the forkserver's children, forked in rank order."""
    children = process_tree.children()
    return max((sorted(children.get(c, [])) for c in children.get(cli, [])), key=len)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("signame", "cause"),
    [
        ("SIGKILL", "killed by SIGKILL (by a user, or by the kernel when memory ran out)"),
        ("SIGSTOP", "stopped (SIGSTOP, SIGTSTP or a debugger); its peers timed out waiting for it"),
    ],
)
def test_a_killed_or_stopped_rank_is_one_line_naming_it(tmp_path, process_tree, signame, cause):
    """kill -9 or SIGSTOP of rank 1 mid-run: one error line naming rank 1 and the cause (a
    stopped rank is found when its peers' collective timeout passes), its traceback in the run's
    logs, exit 1, and no process of the run left (the stopped one included)."""
    out = tmp_path / "run"
    command = [*TRAIN, "--nproc", "2", "--steps", "2000", "--set", "checkpoint_every=1"]
    command += ["--timeout", "5", "--out-dir", str(out)]
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "latest").exists():
            assert parent.poll() is None, f"train exited early: {stderr.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        everything = process_tree.descendants(parent.pid)
        ranks = _ranks(process_tree, parent.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], getattr(signal, signame))
        code = parent.wait(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    text = stderr.read_text()
    assert code == 1, text[-3000:]
    (line,) = _error_lines(text)
    log = out / "logs" / "rank1.log"
    assert line == f"error: rank 1: {cause} (traceback in {log})"
    assert "Traceback" not in text and log.is_file()
    deadline = time.monotonic() + 10
    while any(process_tree.alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in everything if process_tree.alive(p)], "processes outlived the run"


class _FullDisk(io.FileIO):
    """A file on a disk that fills up: the first write keeps a few bytes, then ENOSPC."""

    def write(self, data) -> int:  # type: ignore[no-untyped-def]
        super().write(bytes(memoryview(data).cast("B")[:16]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)


def _train_until_the_disk_fills(cfg, full_at_step: int):
    """Train; rank 1's checkpoint writes of ``full_at_step`` hit a full disk (inside DCP's own
    writer, so DCP's error handling across ranks is the real one)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream
    staging = f".tmp-step_{full_at_step:07d}"

    @contextmanager
    def create_stream(self, path, mode):
        if dist.get_rank() == 1 and "w" in mode and staging in str(path):
            with _FullDisk(path, "wb") as stream:
                yield stream
            return
        with original(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream
    return train_rank(cfg, False)


@pytest.mark.distributed
def test_a_full_disk_while_saving_is_one_line_and_leaves_no_staging_folder(tmp_path, capsys):
    """ENOSPC while a checkpoint is written: one line naming the cause and the file, the
    half-written staging folder removed, the previous checkpoint intact and still ``latest``."""
    cfg = load_config(
        debug(), overrides=[f"out_dir={str(tmp_path)!r}", "checkpoint_every=5", "steps=12"]
    )
    with pytest.raises(typer.Exit) as exited, rank_failures(tmp_path / "logs"):
        launch(_train_until_the_disk_fills, 2, cfg, 10, backend=None, timeout=240)
    assert exited.value.exit_code == 1
    line = capsys.readouterr().err.strip()
    staging = tmp_path / "checkpoints" / ".tmp-step_0000010"
    pattern = (
        rf"error: rank [01]: no space left on the device: {re.escape(str(staging))}/\S+ "
        rf"\(traceback in {re.escape(str(tmp_path / 'logs'))}/rank[01]\.log\)"
    )
    assert re.fullmatch(pattern, line), line
    assert not staging.exists()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000005"]
    assert (root / "latest").read_text() == "step_0000005"
    assert checkpoint.latest(root) == root / "step_0000005"
