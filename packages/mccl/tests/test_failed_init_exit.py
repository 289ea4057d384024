"""A failed initialisation fails fast and for good, and the process exits cleanly.

The whole-process tests run real interpreters (``sys.executable``): what they check, the exit
status and what is printed while the interpreter shuts down, does not exist inside a pytest
worker or under ``npu_core.dist.launch`` (whose ranks leave through ``os._exit``).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mccl
from npu_core.dist import LOOPBACK, find_free_port, launch

pytestmark = pytest.mark.distributed

JOB = Path(__file__).with_name("_absent_rank_job.py")
IMPORT_LIMIT_S = 300.0  # importing torch on a loaded 2-core machine took up to 30 s
MARGIN_S = 2.0
"""From init start to the last exit handler (mccl's has run): init_timeout plus this."""
TEARDOWN_S = 10.0
"""Then the interpreter's own teardown (its garbage collection of torch's modules): 2.1-4.9 s
measured on a loaded 2-core machine, an empty script importing torch included."""


def _run_ranks(ranks: list[int], world_size: int, args: list[str], tmp_path: Path) -> list[dict]:
    """Start ``ranks`` of a ``world_size`` job, release them together, time each exit."""
    env = {
        **os.environ,
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(find_free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    procs, logs = [], []
    for rank in ranks:
        log = (tmp_path / f"rank{rank}.stderr").open("w+")
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
                    "after": ended.get(i),  # from the go signal to the process's end
                    "exit_ready": ready,  # from init start to mccl's exit handler done
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


def test_missing_rank_fails_once_and_exits_cleanly(tmp_path):
    """3-rank job, rank 2 never started: ranks 0 and 1 name it once and exit with status 1.

    Rank 1 keeps finalising until rank 0 has exited, closing the store it hosts. A thread still
    inside a store call then gets its connection reset while the interpreter shuts down, and
    the process aborts ("terminate called without an active exception", status 134): mccl must
    have left the store by then. Without the linger the same happens whenever rank 1 happens to
    finalise more slowly than rank 0.
    """
    init_timeout = 4.0
    first, second = _run_ranks([0, 1], 3, [str(init_timeout), "use", "linger"], tmp_path)
    for result in (first, second):
        stderr, rank = result["stderr"], result["rank"]
        assert result["returncode"] == 1, f"rank {rank}: status {result['returncode']}\n{stderr}"
        assert "terminate called" not in stderr and "Aborted" not in stderr, stderr
        # Raised once: the same exception object again (torch's c10d_logger calls
        # is_initialized() while handling it) prints no "During handling ..." chain.
        assert stderr.count("mccl.errors.InitTimeoutError: ") == 1, stderr
        assert "ranks [2] of 3" in stderr, stderr
        assert result["exit_ready"] <= init_timeout + MARGIN_S, (rank, result["exit_ready"])
    assert first["after"] <= init_timeout + MARGIN_S + TEARDOWN_S, first["after"]
    assert second["after"] <= first["after"] + TEARDOWN_S, (first["after"], second["after"])


def test_exit_while_init_pending_is_prompt_and_clean(tmp_path):
    """A script that ends before its peers arrive exits at once, not at init_timeout."""
    (result,) = _run_ranks([0], 2, ["60", "exit"], tmp_path)
    assert result["returncode"] == 0, result["stderr"]
    assert "terminate called" not in result["stderr"], result["stderr"]
    assert result["exit_ready"] <= MARGIN_S, result
    assert result["after"] is not None and result["after"] <= MARGIN_S + TEARDOWN_S, result


def _calls_after_failure(init_timeout: float) -> dict:
    handle = mccl.init_process_group(
        "gloo",
        init_method=f"tcp://{LOOPBACK}:{find_free_port()}",
        rank=0,
        world_size=3,
        init_timeout=init_timeout,
    )
    start = time.monotonic()
    try:
        dist.get_rank()
    except mccl.InitTimeoutError as exc:
        first = exc
    first_after = time.monotonic() - start
    calls = {
        "is_initialized": dist.is_initialized,
        "get_world_size": dist.get_world_size,
        "all_reduce": lambda: dist.all_reduce(torch.ones(1)),
        "barrier": dist.barrier,
        "dist.new_group": lambda: dist.new_group([0]),
        "mccl.new_group": lambda: mccl.new_group([0]).wait(),
        "mccl.wait": mccl.wait,
        "handle.wait": handle.wait,
        "handle.wait(60)": lambda: handle.wait(60.0),
    }
    outcomes = {}
    for name, call in calls.items():
        began = time.monotonic()
        try:
            call()
            outcome = "returned"
        except BaseException as exc:  # the test reports whatever came out
            outcome = "same" if exc is first else f"{type(exc).__name__}: {exc}"
        outcomes[name] = (outcome, time.monotonic() - began)
    return {
        "first_after": first_after,
        "missing": first.missing_ranks,
        "outcomes": outcomes,
        "done": handle.done(),
        "exception_is_first": handle.exception() is first,
        "ready": mccl.is_ready(),
    }


def test_every_call_after_a_failure_raises_the_same_error_at_once():
    """After InitTimeoutError, queries, collectives, new_group and waits re-raise it, no wait."""
    init_timeout = 2.0
    (result,) = launch(_calls_after_failure, 1, init_timeout, backend=None, timeout=120)
    assert result["missing"] == [1, 2]
    assert init_timeout * 0.9 <= result["first_after"] <= init_timeout + MARGIN_S
    for name, (outcome, seconds) in result["outcomes"].items():
        assert outcome == "same", f"{name}: {outcome}"
        assert seconds < 1.0, f"{name} took {seconds:.2f} s: it waited again"
    assert result["done"] and result["exception_is_first"] and not result["ready"]
