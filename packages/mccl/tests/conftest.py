"""Shared fixtures of mccl's tests (given to tests as fixtures, never imported by them)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from npu_core.dist import LOOPBACK, find_free_port

JOB = Path(__file__).with_name("_absent_rank_job.py")
IMPORT_LIMIT_S = 300.0  # importing torch on a loaded 2-core machine took up to 30 s


class RankJobs:
    """Start some ranks of a job as whole interpreters running ``_absent_rank_job.py``.

    The ranks import torch first and are then released together, so timings start at the
    same moment whatever each import cost. What they check, the exit status and what is
    printed while the interpreter shuts down, does not exist inside a pytest worker or under
    ``npu_core.dist.launch`` (whose ranks leave through ``os._exit``).
    """

    margin_s = 2.0
    """From init start to the last exit handler (mccl's has run): init_timeout plus this."""

    teardown_s = 10.0
    """Then the interpreter's own teardown (its garbage collection of torch's modules): 2.1-4.9 s
    measured on a loaded 2-core machine, an empty script importing torch included."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def run(
        self,
        ranks: list[int],
        world_size: int,
        args: list[str],
        *,
        port: int | None = None,
        after_go: Callable[[int], Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Start ``ranks`` of a ``world_size`` job, release them together, time each exit.

        Args:
            ranks: the ranks to start (the others never come).
            world_size: the job's size.
            args: the job script's arguments (``INIT_TIMEOUT use|exit [linger]``).
            port: the store's port (default: a free one).
            after_go: called with the port right after the ranks are released (to play a
                rank from the test process); its result is kept alive until the ranks end.

        Returns:
            Per rank: ``returncode``, ``after`` (go to process end, s), ``exit_ready`` (init
            start to mccl's exit handler done, s) and ``stderr``.
        """
        port = find_free_port() if port is None else port
        env = {
            **os.environ,
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
        procs, logs = [], []
        for rank in ranks:
            log = (self.tmp_path / f"rank{rank}.stderr").open("w+")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOB), *args],
                    env={**env, "RANK": str(rank)},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            )
            logs.append(log)
        try:
            for proc, log in zip(procs, logs, strict=True):
                line = _read_line(proc, IMPORT_LIMIT_S)
                assert line == "ready", f"rank did not start: {line!r}\n{_text(log)}"
            start = time.monotonic()
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            _keep = after_go(port) if after_go is not None else None
            ended: dict[int, float] = {}
            limit = start + float(args[0]) + 60.0  # a hang fails the test instead of blocking it
            while len(ended) < len(procs) and time.monotonic() < limit:
                for i, proc in enumerate(procs):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = time.monotonic() - start
                time.sleep(0.02)
            results = []
            for i, (rank, proc, log) in enumerate(zip(ranks, procs, logs, strict=True)):
                returncode = proc.poll()
                stamps = {}
                if returncode is not None:
                    for line in proc.stdout.read().splitlines():
                        name, _, value = line.partition(" ")
                        stamps[name] = float(value)
                ready = stamps.get("exit-ready", float("inf")) - stamps.get("init-start", 0.0)
                results.append(
                    {
                        "rank": rank,
                        "returncode": returncode,
                        "after": ended.get(i),
                        "exit_ready": ready,
                        "stderr": _text(log),
                    }
                )
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    if not readable:
        return "<timed out>"
    return proc.stdout.readline().strip() or f"<exited with {proc.wait()}>"


def _text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


@pytest.fixture
def rank_jobs(tmp_path: Path) -> RankJobs:
    """Starts ranks of a job as whole interpreters (see :class:`RankJobs`)."""
    return RankJobs(tmp_path)
