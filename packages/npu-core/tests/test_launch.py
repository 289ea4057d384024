"""npu_core.dist.launch: results, failures, deaths and timeouts across real gloo ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from npu_core.dist import LaunchTimeoutError, RankExitedError, RemoteTraceback, launch
from npu_core.dist.launch import FORKSERVER_PRELOAD

pytestmark = pytest.mark.distributed


def _sum_of_ranks(scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise KeyError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without termination
    return 0


def _die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(60)


def _hang() -> None:
    time.sleep(60)


def _env_without_group() -> tuple[bool, str, str]:
    return dist.is_initialized(), os.environ["RANK"], os.environ["MASTER_ADDR"]


def _unpicklable_error() -> None:
    class Local(Exception):
        pass

    raise Local("cannot cross a process boundary")


def test_launch_returns_each_rank_value_in_rank_order():
    """Every rank's return value comes back, indexed by rank, after a real all_reduce."""
    assert launch(_sum_of_ranks, 3, 10) == [(r, 3, 30.0) for r in range(3)]


def test_launch_reraises_first_failure_with_remote_traceback():
    """The failing rank's own exception type is raised; the remote traceback is its cause."""
    start = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank one") as info:
        launch(_fail_on_rank_one, 2, timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.rank == 1
    assert "_fail_on_rank_one" in str(cause)
    assert time.monotonic() - start < 30, "the surviving rank must be terminated, not awaited"


def test_launch_reports_rank_that_died_without_result():
    """A rank killed or exiting early is reported with its exit code, well before the timeout."""
    start = time.monotonic()
    with pytest.raises(RankExitedError, match="rank 1 exited with code 7"):
        launch(_die_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_launch_times_out_instead_of_hanging():
    """A hung run raises LaunchTimeoutError naming the unfinished ranks."""
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match=r"ranks \[0, 1\] of 2"):
        launch(_hang, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_launch_without_backend_sets_torchrun_env_only():
    """backend=None leaves initialisation to the function but still sets torchrun's variables."""
    assert launch(_env_without_group, 2, backend=None) == [
        (False, "0", "127.0.0.1"),
        (False, "1", "127.0.0.1"),
    ]


def test_launch_wraps_exceptions_that_do_not_pickle():
    """An exception class local to the rank still surfaces, as RankFailedError with its text."""
    with pytest.raises(RuntimeError, match="cannot cross a process boundary"):
        launch(_unpicklable_error, 1, backend=None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "timeout": 0.0}, "timeout"),
        ({"world_size": 1, "start_method": "fork"}, "start_method='fork'"),
    ],
)
def test_launch_rejects_bad_arguments(kwargs, message):
    """Bad sizes, timeouts and start methods are refused up front, naming the argument."""
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        launch(_hang, world_size, **kwargs)


def test_launch_with_spawn_start_method():
    """Fresh interpreters (spawn) work too, for platforms without forkserver."""
    assert launch(_sum_of_ranks, 2, 1, start_method="spawn") == [(0, 2, 1.0), (1, 2, 1.0)]


def _modules_loaded_at_start() -> list[str]:
    import sys

    return [name for name in FORKSERVER_PRELOAD if name in sys.modules]


def test_forkserver_ranks_start_with_distributed_modules_loaded():
    """Ranks fork from a server that already imported FSDP2, pipelining and DCP (each rank
    importing them took seconds per launch with several ranks on few cores); a spawned rank
    is a fresh interpreter and has none of the distributed sub-packages."""
    assert set(FORKSERVER_PRELOAD) >= {"torch.distributed.fsdp", "torch.distributed.pipelining"}
    for loaded in launch(_modules_loaded_at_start, 2, backend=None):
        assert loaded == list(FORKSERVER_PRELOAD)
    spawned = launch(_modules_loaded_at_start, 1, backend=None, start_method="spawn")[0]
    assert "torch.distributed.pipelining" not in spawned


def _world_seen_by_run() -> list[tuple[int, int]]:
    from npu_core.dist import is_torchrun, run

    assert is_torchrun()
    return run(_rank_and_world, 99)


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_run_joins_torchrun_job_instead_of_spawning():
    """Under torchrun's variables, run() initialises from env:// and runs fn in this process."""
    assert launch(_world_seen_by_run, 2, backend=None) == [[(0, 2)], [(1, 2)]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGKILL"])
def test_termination_signal_stops_every_rank(tmp_path, signame):
    """SIGTERM / SIGHUP to the launching process stop both ranks and their forkserver, and the
    launcher exits with 128 + signal, instead of leaving the ranks running as orphans. SIGKILL
    leaves the launcher no cleanup at all: the ranks notice its death themselves."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).with_name("_signalled_job.py")
    parent = subprocess.Popen([sys.executable, str(job), str(tmp_path)])
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("rank*.pids"))) < 2:
            assert parent.poll() is None, f"launcher exited early with {parent.returncode}"
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        pids = [tuple(map(int, p.read_text().split())) for p in tmp_path.glob("rank*.pids")]
        signum = getattr(signal, signame)
        parent.send_signal(signum)
        expected = -signum if signum == signal.SIGKILL else 128 + signum
        assert parent.wait(timeout=30) == expected
    finally:
        if parent.poll() is None:
            parent.kill()
    ranks = [rank for rank, _ in pids]
    forkservers = {server for _, server in pids}
    deadline = time.monotonic() + 10  # init reaps the reparented processes
    while any(_alive(pid) for pid in (*ranks, *forkservers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "ranks outlived the launcher"
    assert not [pid for pid in forkservers if _alive(pid)], "the forkserver outlived the launcher"
