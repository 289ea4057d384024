"""A rank killed during a pipeline-parallel run of the real ``hyperparallel train`` launcher: the
job fails in one line naming that rank, and no process of the run is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.distributed
@pytest.mark.slow  # a 4-rank CLI run to its first checkpoint: 1-2 min on a loaded 2-core CI
def test_killed_pipeline_rank_is_named_and_leaves_no_process(tmp_path, process_tree):
    """SIGKILL to the last pipeline stage's rank mid-run under ``pp=2,dp_shard=2``: the CLI
    exits non-zero naming rank 3 and the signal; the other ranks (blocked in stage
    send/recv or collectives with the dead one), the forkserver and every helper are gone."""
    command = [sys.executable, "-m", "hyperparallel.cli", "train", "--preset", "debug"]
    command += ["--nproc", "4", "--mesh", "pp=2,dp_shard=2", "--steps", "2000"]
    command += ["--set", "checkpoint_every=2", "--set", "model.n_layers=2"]
    command += ["--out-dir", str(tmp_path / "run")]
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        # Training is under way once the first checkpoint exists (every rank took 2 steps).
        while not (tmp_path / "run" / "checkpoints" / "latest").exists():
            assert parent.poll() is None, f"train exited early: {stderr.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        children = process_tree.children()
        # The forkserver is the CLI's child whose children are the 4 ranks, forked in rank
        # order (ascending pids).
        ranks = max((sorted(children.get(c, [])) for c in children[parent.pid]), key=len)
        assert len(ranks) == 4, ranks
        everything = process_tree.descendants(parent.pid)
        rank3 = ranks[3]  # rank 3 = pp rank 1, dp_shard rank 1: holds the last stage
        time.sleep(0.5)  # into a later step
        os.kill(rank3, signal.SIGKILL)
        code = parent.wait(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    text = stderr.read_text()
    assert code != 0
    assert re.search(r"error: rank 3: killed by SIGKILL", text), text[-3000:]
    deadline = time.monotonic() + 10
    while any(process_tree.alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in everything if process_tree.alive(p)], "processes outlived the run"
