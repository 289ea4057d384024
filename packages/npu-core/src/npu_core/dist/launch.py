"""Run a function on N local ranks, each in its own process, and collect what each returns.

Used by every multi-rank test, benchmark and CLI of the project. Guarantees: the rendezvous binds
to loopback only; the first rank to fail has its exception re-raised here with the remote
traceback attached; the remaining ranks are terminated; a run that outlives ``timeout`` raises
``LaunchTimeoutError`` naming the ranks that had not finished, instead of hanging; SIGTERM or
SIGHUP to the launching process stops every rank before it exits (status 128 + signal), as
SIGINT does, instead of leaving them training as orphans; and a launcher that dies without any
cleanup (``kill -9``, a crash) takes its ranks with it, because each rank watches it.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from npu_core import env
from npu_core.capability import threads_per_process
from npu_core.device import comm_backend

LOOPBACK = "127.0.0.1"
_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A rank raised an exception that could not be sent back as itself (it did not pickle)."""


class RankExitedError(RuntimeError):
    """A rank's process died without reporting a result (killed, crashed, ``os._exit``)."""

    def __init__(self, message: str, *, rank: int, exitcode: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        """The process's exit status: negative for the signal that killed it, as Popen's."""


class RankStoppedError(RuntimeError):
    """A rank's process is stopped (SIGSTOP, SIGTSTP, a debugger): alive, but it cannot run.

    Its peers wait for it in a collective until their timeout; the error they then report is
    a symptom, so the launcher names the stopped rank instead.
    """

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class LaunchTimeoutError(TimeoutError):
    """The ranks did not all finish within the launch timeout."""


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback; set as ``__cause__`` of the re-raised exception."""

    def __init__(self, rank: int, formatted: str) -> None:
        super().__init__(f"\n\n--- traceback of rank {rank} ---\n{formatted}")
        self.rank = rank


def find_free_port(host: str = LOOPBACK) -> int:
    """Ask the OS for a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout_s: float,
    results: Any,
) -> None:
    """Entry point of one rank: set torchrun's environment, init, run ``fn``, report back."""
    _exit_with_launcher()
    env.set_rank_environment(LOOPBACK, port, rank, world_size)
    torch.set_num_threads(threads_per_process(world_size))
    try:
        if backend is not None:
            torch.distributed.init_process_group(
                backend,
                init_method=f"tcp://{LOOPBACK}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        value = fn(*args)
        results.put((rank, "ok", _dumps_or_error(value, rank)))
    except BaseException as exc:
        formatted = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(RankFailedError(f"rank {rank}: {type(exc).__name__}: {exc}"))
        results.put((rank, "error", (payload, formatted)))
    finally:
        if backend is not None and torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()


def _exit_with_launcher() -> None:
    """End this rank as soon as the process that launched it is gone, however it died.

    A launcher killed with SIGKILL runs no cleanup, and Linux does not stop children with their
    parent: the ranks would go on training, and, since each holds the forkserver's and the
    resource tracker's pipes open, those would stay too. multiprocessing gives every child a
    sentinel, the read end of a pipe whose only writer is the launcher, which turns readable when
    the launcher's file descriptors close, i.e. when it exits for any reason. A daemon thread
    waits on it and exits the rank at once (no cleanup: the peers and the job are gone anyway).
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(128 + signal.SIGHUP)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def _dumps_or_error(value: Any, rank: int) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a {type(value).__name__}, which does not pickle"
        ) from exc


START_METHODS = ("forkserver", "spawn")

FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
)
"""Modules the forkserver imports once, so that ranks forked from it start with them loaded.

Distributed jobs import FSDP2, pipelining (which pulls in ``torch._dynamo``, ~2 s alone) and
DCP; imported in every rank, four ranks on two cores spent 5-10 s per launch on it. Preloading
costs that once per process that launches, on its first launch."""


def _context(start_method: str) -> Any:  # Spawn- or ForkServerContext (BaseContext lacks Process)
    # forkserver with torch preloaded: ranks fork from a server that imported torch and DTensor
    # once, instead of each re-importing them (see benchmarks/launch_startup.py), and unlike
    # fork they never inherit the parent's threads or device state.
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}; use one of {START_METHODS}")
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str | None = "default",
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks and return each rank's return value.

    Each rank is a fresh process with torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) pointing at a free loopback port, and, unless
    ``backend`` is None, an initialised default process group.

    Args:
        fn: a module-level (picklable) function; it reads its rank from torch.distributed or
            the environment.
        world_size: number of ranks, >= 1.
        *args: positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run, start-up included; also the process-group timeout.
        backend: ``"default"`` for ``npu_core.device.comm_backend()`` (gloo on CPU), a backend
            name, or None to leave process-group initialisation to ``fn`` (e.g. to test mccl).
        start_method: ``"forkserver"`` (ranks fork from a server that imported torch once; about
            70x faster to start here) or ``"spawn"`` (each rank a fresh interpreter).

    Returns:
        The return values, indexed by rank.

    Raises:
        ValueError: ``world_size`` or ``timeout`` out of range.
        Exception: the first failing rank's own exception, its ``__cause__`` a RemoteTraceback
            holding the rank's traceback.
        RankExitedError: a rank died without reporting.
        LaunchTimeoutError: not every rank finished within ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if backend == "default":
        backend = comm_backend().value
    ctx = _context(start_method)
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, rank, world_size, port, backend, timeout, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    with _exit_on_termination_signals():
        for proc in procs:
            proc.start()
        try:
            values = _collect(procs, results, timeout)
            _join(procs, _GRACE_S)
            return values
        finally:
            _terminate(procs)
            results.close()


_TERMINATION_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


@contextlib.contextmanager
def _exit_on_termination_signals() -> Iterator[None]:
    """Turn SIGTERM / SIGHUP into ``SystemExit(128 + signal)`` while ranks run.

    Their default action kills this process on the spot: no ``finally`` runs, so the ranks
    (reparented to init) would go on training and writing. As an exception they unwind through
    :func:`launch`'s cleanup like Ctrl-C does, and the exit status is still the shell's 128 +
    signal. Only the first signal raises; repeats during cleanup are ignored so that cleanup
    finishes. Signal handlers belong to the main thread: elsewhere nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in _TERMINATION_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _collect(procs: list[Any], results: Any, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = sorted(set(range(len(procs))) - values.keys())
            timed_out = LaunchTimeoutError(
                f"ranks {pending} of {len(procs)} did not finish within {timeout:g} s "
                "(a hang, a rank waiting for a peer that failed, or a timeout too short)"
            )
            stopped = _stopped_rank(procs, values)
            if stopped is not None:
                raise stopped from timed_out
            raise timed_out
        try:
            rank, status, payload = results.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            _check_exits(procs, values, results)
            continue
        if status == "error":
            exc_payload, formatted = payload
            exc = pickle.loads(exc_payload)
            exc.__cause__ = RemoteTraceback(rank, formatted)
            # A peer's "connection closed" is a symptom; a rank that died silently is the cause.
            dead = _silently_dead(procs, values, rank)
            if dead is not None:
                raise dead from exc
            raise exc
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(len(procs))]


def _silently_dead(
    procs: list[Any], values: dict[int, Any], reporter: int
) -> RankExitedError | RankStoppedError | None:
    """The rank that caused ``reporter``'s failure, if another rank died or stopped first."""
    time.sleep(0.05)  # let the dying rank's exit status settle
    for rank, proc in enumerate(procs):
        if rank != reporter and rank not in values and proc.exitcode not in (None, 0):
            return RankExitedError(
                f"rank {rank} exited with code {proc.exitcode} without reporting a result "
                f"(rank {reporter} failed next, see the chained exception)",
                rank=rank,
                exitcode=proc.exitcode,
            )
    return _stopped_rank(procs, values)


def _stopped_rank(procs: list[Any], values: dict[int, Any]) -> RankStoppedError | None:
    for rank, proc in enumerate(procs):
        if rank not in values and proc.pid is not None and _is_stopped(proc.pid):
            return RankStoppedError(
                f"rank {rank} (pid {proc.pid}) is stopped (SIGSTOP, SIGTSTP or a debugger), "
                "so its peers waited for it until the timeout",
                rank=rank,
            )
    return None


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is in the stopped or traced state (Linux ``/proc``; False elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def _check_exits(procs: list[Any], values: dict[int, Any], results: Any) -> None:
    """Fail fast when a rank died without reporting (otherwise we would wait for the timeout)."""
    for rank, proc in enumerate(procs):
        if rank in values or proc.is_alive():
            continue
        # It may have reported just before exiting: give the queue's feeder a moment.
        with contextlib.suppress(queue.Empty):
            item = results.get(timeout=1.0)
            results.put(item)
            return
        raise RankExitedError(
            f"rank {rank} exited with code {proc.exitcode} without reporting a result "
            "(killed by a signal if negative, out of memory, or os._exit)",
            rank=rank,
            exitcode=proc.exitcode,
        )


def _join(procs: list[Any], grace: float) -> None:
    """Let ranks that all reported a result finish exiting on their own, for up to ``grace`` s.

    A rank still runs multiprocessing's exit finalizers after it reports: they unlink the
    semaphores it created (tqdm's multiprocessing lock, made by any progress bar, is one). A
    rank terminated in that window leaves them to the resource tracker, which warns about
    "leaked semaphore objects" when the launching process exits.
    """
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def _terminate(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
