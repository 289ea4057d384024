"""Rendezvous: reach the shared store, announce this rank, wait until every rank has.

The arrival keys are what lets a timeout name the ranks that never came, instead of a bare
"timed out" from deep inside process-group construction. Every wait here is made of short steps
or non-blocking calls, so that the initialising thread can give up at the deadline, or when the
interpreter exits, instead of sitting in a C++ store call (``mccl._worker`` says why that
matters).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import ParseResult, urlparse

import torch.distributed as dist

# torch.distributed re-exports these without declaring them (no `as`, not in __all__)
from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.rendezvous import rendezvous

from mccl import env
from mccl.config import InitRequest
from mccl.errors import InitTimeoutError, MCCLError

POLL_S = 0.5
"""Longest single blocking call while waiting for peers (a connection attempt to the store);
also how often the ranks still missing are listed one by one."""

_PROBE_PAUSE_S = 0.1
_POLL_FRACTION = 0.05
_MIN_PAUSE_S = 0.0005
_MAX_PAUSE_S = 0.05


def store_address(request: InitRequest) -> str:
    """``host:port`` of the store for env:// and tcp://, else the init URL itself."""
    url = urlparse(request.init_method)
    if url.scheme == "env":
        port = env.integer(env.MASTER_PORT)
        return f"{env.master_addr() or '?'}:{'?' if port is None else port}"
    if url.scheme == "tcp":
        return f"{url.hostname}:{url.port}"
    return request.init_method


def abandoned_error(request: InitRequest) -> MCCLError:
    """What the thread records when it stops early because the interpreter is exiting."""
    return MCCLError(
        f"mccl initialisation of rank {request.rank} was abandoned: the interpreter exited first"
    )


def connect_store(request: InitRequest, deadline: float, stop: threading.Event) -> Store:
    """Create (rank 0) or join the rendezvous store before ``deadline`` (a monotonic time).

    For env:// and tcp:// the store is built here without waiting for workers: torch's own
    handler makes rank 0 block in the constructor until everyone connects, and then fails
    without saying who is missing. Other schemes (file://) go through torch's rendezvous.

    A joining rank first waits in Python, in :data:`POLL_S` steps, until the store's port
    accepts a connection, and only then creates torch's client. Handing an absent store to
    torch's client instead costs up to twice its timeout (it retries once after a pause),
    cannot be stopped, and when it gives up c10d logs the error with about 30 lines of C++
    stack frames on stderr. When the store is up (always under torchrun) the probe is one
    loopback connection, answered at once and closed; the store logs nothing for it.

    Raises:
        InitTimeoutError: the store did not accept connections before ``deadline`` (rank 0,
            which hosts it, never arrived).
        MCCLError: ``stop`` was set first, or rank 0 could not host the store (port taken).
    """
    url = urlparse(request.init_method)
    if url.scheme not in ("env", "tcp"):
        timeout = datetime.timedelta(seconds=request.init_timeout_s)
        # torch's rendezvous handlers are untyped; each yields (store, rank, world_size)
        store: Store = next(
            rendezvous(request.init_method, request.rank, request.world_size, timeout=timeout)
        )[0]
        return store
    host, port = _host_port(request, url)
    env_store = (env.master_addr(), env.integer(env.MASTER_PORT))
    agent_serves = env.agent_serves_store() and env_store == (host, port)
    is_master = request.rank == 0 and not agent_serves
    if is_master:
        store = _host_store(request, host, port)
    else:
        _await_listener(host, port, request, deadline, stop)
        store = _join_store(request, host, port, deadline)
    # Later get()s without their own timeout (process-group construction) use the store's.
    store.set_timeout(datetime.timedelta(seconds=request.init_timeout_s))
    return store


def _host_store(request: InitRequest, host: str, port: int) -> TCPStore:
    try:
        return _tcp_store(request, host, port, True, request.init_timeout_s)
    except (RuntimeError, dist.DistError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        error = MCCLError(
            f"rank 0 could not host the rendezvous store on {host}:{port}: {reason}; another "
            "job may hold that port (choose another MASTER_PORT / tcp:// port)"
        )
    raise error  # outside the handler: torch's exception is not chained in front of ours


def _join_store(request: InitRequest, host: str, port: int, deadline: float) -> TCPStore:
    try:
        return _tcp_store(request, host, port, False, max(deadline - time.monotonic(), POLL_S))
    except (RuntimeError, dist.DistError):
        pass  # the listener went away between the probe and the connection
    raise _unreachable_error(request, host, port)


def _tcp_store(
    request: InitRequest, host: str, port: int, is_master: bool, timeout_s: float
) -> TCPStore:
    return TCPStore(
        host,
        port,
        request.world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )


def _await_listener(
    host: str, port: int, request: InitRequest, deadline: float, stop: threading.Event
) -> None:
    while True:
        remaining = deadline - time.monotonic()
        if stop.is_set():
            raise abandoned_error(request)
        if remaining <= 0:
            raise _unreachable_error(request, host, port)
        try:
            with socket.create_connection((host, port), timeout=min(POLL_S, remaining)):
                return
        except OSError:
            stop.wait(min(_PROBE_PAUSE_S, max(deadline - time.monotonic(), 0.0)))


def _unreachable_error(request: InitRequest, host: str, port: int) -> InitTimeoutError:
    return InitTimeoutError(
        f"rank {request.rank} could not reach the rendezvous store at {host}:{port} within "
        f"{request.init_timeout_s:g} s: rank 0, which hosts it, never arrived (or MASTER_ADDR "
        "/ MASTER_PORT point elsewhere)",
        missing_ranks=[0],
        address=f"{host}:{port}",
        timeout=request.init_timeout_s,
    )


def _host_port(request: InitRequest, url: ParseResult) -> tuple[str, int]:
    if url.scheme == "tcp":
        if url.hostname is None or url.port is None:
            raise ValueError(f"init_method {request.init_method!r} needs tcp://HOST:PORT")
        return url.hostname, url.port
    addr, port = env.master_addr(), env.integer(env.MASTER_PORT)
    missing = [
        name for name, value in ((env.MASTER_ADDR, addr), (env.MASTER_PORT, port)) if not value
    ]
    if missing or addr is None or port is None:
        raise ValueError(
            f"init_method env:// needs {' and '.join(missing)} in the environment "
            "(torchrun sets them), or pass init_method='tcp://HOST:PORT'"
        )
    return addr, port


def announce(store: Store, request: InitRequest) -> None:
    """Register this rank's arrival, for :func:`await_arrivals` on every rank."""
    store.set(_arrival_key(request.rank), str(os.getpid()))


def _arrival_key(rank: int) -> str:
    return f"mccl/arrived/{rank}"


def await_arrivals(
    store: Store,
    request: InitRequest,
    deadline: float,
    stop: threading.Event,
    on_missing: Callable[[list[int]], None] | None = None,
) -> None:
    """Return once every rank has announced itself in ``store``.

    Process-group construction would wait for the peers anyway, but inside one C++ call bounded
    only by the collective timeout (30 min by default). So the waiting happens here, with
    non-blocking ``check`` calls: a blocking ``store.wait`` in short steps would do, but TCPStore
    logs two warnings for every step that times out. The pause between checks grows with the
    time waited (:data:`_POLL_FRACTION` of it, from 0.5 ms to 50 ms), so the wait overshoots
    the last arrival by at most that fraction and a long wait costs a few requests a second.
    The ranks still missing are listed again, one check each, every :data:`POLL_S`, and handed
    to ``on_missing`` (what a caller reports while it waits).

    Raises:
        InitTimeoutError: ``deadline`` passed with ranks missing, or the store closed (its host
            gave up) while they were; ``missing_ranks`` names them.
        MCCLError: ``stop`` was set first.
    """
    pending = list(range(request.world_size))
    listed = False  # whether ``pending`` has been listed key by key (else: everyone)
    started = listed_at = time.monotonic()
    while True:
        try:
            if store.check([_arrival_key(rank) for rank in pending]):
                return
            now = time.monotonic()
            if now >= deadline or stop.is_set() or now - listed_at >= POLL_S:
                pending = [rank for rank in pending if not store.check([_arrival_key(rank)])]
                listed, listed_at = True, now
                if on_missing is not None:
                    on_missing(pending)
        except (RuntimeError, dist.DistError) as exc:
            raise _store_lost_error(request, pending if listed else None) from exc
        if not pending:
            return
        if stop.is_set():
            raise abandoned_error(request)
        if now >= deadline:
            raise timeout_error(request, pending)
        pause = min(max((now - started) * _POLL_FRACTION, _MIN_PAUSE_S), _MAX_PAUSE_S)
        stop.wait(min(pause, deadline - now))


def timeout_error(request: InitRequest, missing: list[int]) -> InitTimeoutError:
    """The error for ranks that never arrived within ``init_timeout``."""
    return InitTimeoutError(
        f"ranks {missing} of {request.world_size} never arrived at the rendezvous store "
        f"{store_address(request)} within {request.init_timeout_s:g} s (seen from rank "
        f"{request.rank}); check that every rank was started and can reach that address",
        missing_ranks=missing,
        address=store_address(request),
        timeout=request.init_timeout_s,
    )


def _store_lost_error(request: InitRequest, missing: list[int] | None) -> MCCLError:
    address = store_address(request)
    if not missing:
        return MCCLError(
            f"rank {request.rank} lost its connection to the rendezvous store {address} while "
            "waiting for the other ranks (its host, rank 0 or torchrun's agent, exited)"
        )
    # Typically rank 0 reached its own init_timeout a moment earlier and closed the store: from
    # here it is the same timeout, and these are the same absent ranks.
    return InitTimeoutError(
        f"ranks {missing} of {request.world_size} had not arrived at the rendezvous store "
        f"{address} when it closed (seen from rank {request.rank}; its host, rank 0 or "
        "torchrun's agent, gave up or exited); check that every rank was started and can reach "
        "that address",
        missing_ranks=missing,
        address=address,
        timeout=request.init_timeout_s,
    )
