"""A failed initialisation fails fast and for good, and the process exits cleanly.

The whole-process tests run real interpreters (``sys.executable``): what they check, the exit
status and what is printed while the interpreter shuts down, does not exist inside a pytest
worker or under ``npu_core.dist.launch`` (whose ranks leave through ``os._exit``).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import mccl
from npu_core.dist import LOOPBACK, find_free_port, launch

MARGIN_S = 2.0
"""From the first use to the error, at most init_timeout plus this."""


@pytest.mark.distributed
def test_missing_rank_fails_once_and_exits_cleanly(rank_jobs):
    """3-rank job, rank 2 never started: ranks 0 and 1 name it once and exit with status 1.

    Rank 1 keeps finalising until rank 0 has exited, closing the store it hosts. A thread still
    inside a store call then gets its connection reset while the interpreter shuts down, and
    the process aborts ("terminate called without an active exception", status 134): mccl must
    have left the store by then. Without the linger the same happens whenever rank 1 happens to
    finalise more slowly than rank 0.
    """
    init_timeout = 4.0
    first, second = rank_jobs.run([0, 1], 3, [str(init_timeout), "use", "linger"])
    for result in (first, second):
        stderr, rank = result["stderr"], result["rank"]
        assert result["returncode"] == 1, f"rank {rank}: status {result['returncode']}\n{stderr}"
        assert "terminate called" not in stderr and "Aborted" not in stderr, stderr
        # Raised once: the same exception object again (torch's c10d_logger calls
        # is_initialized() while handling it) prints no "During handling ..." chain.
        assert stderr.count("mccl.errors.InitTimeoutError: ") == 1, stderr
        assert "ranks [2] of 3" in stderr, stderr
        assert result["exit_ready"] <= init_timeout + rank_jobs.margin_s, (rank, result)
    assert first["after"] <= init_timeout + rank_jobs.margin_s + rank_jobs.teardown_s, first
    assert second["after"] <= first["after"] + rank_jobs.teardown_s, (first, second)


@pytest.mark.distributed
def test_exit_while_init_pending_is_prompt_and_clean(rank_jobs):
    """A script that ends before its peers arrive exits at once, not at init_timeout."""
    (result,) = rank_jobs.run([0], 2, ["60", "exit"])
    assert result["returncode"] == 0, result["stderr"]
    assert "terminate called" not in result["stderr"], result["stderr"]
    assert result["exit_ready"] <= rank_jobs.margin_s, result
    limit = rank_jobs.margin_s + rank_jobs.teardown_s
    assert result["after"] is not None and result["after"] <= limit, result


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


@pytest.mark.distributed
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
