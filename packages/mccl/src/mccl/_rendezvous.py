"""Rendezvous: reach the shared store, announce this rank, wait until every rank has.

The arrival keys are what lets a timeout name the ranks that never came, instead of a bare
"timed out" from deep inside process-group construction.
"""

from __future__ import annotations

import datetime
import os
from urllib.parse import urlparse

import torch.distributed as dist

from mccl.config import InitRequest
from mccl.errors import InitTimeoutError

_ARRIVED = "mccl/arrived/{rank}"


def store_address(request: InitRequest) -> str:
    """``host:port`` of the store for env:// and tcp://, else the init URL itself."""
    url = urlparse(request.init_method)
    if url.scheme == "env":
        return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if url.scheme == "tcp":
        return f"{url.hostname}:{url.port}"
    return request.init_method


def connect_store(request: InitRequest) -> dist.Store:
    """Create (rank 0) or join the rendezvous store within ``init_timeout``.

    For env:// and tcp:// the store is built here without waiting for workers: torch's own
    handler makes rank 0 block in the constructor until everyone connects, and then fails
    without saying who is missing. Other schemes (file://) go through torch's rendezvous.
    """
    timeout = datetime.timedelta(seconds=request.init_timeout_s)
    url = urlparse(request.init_method)
    if url.scheme not in ("env", "tcp"):
        store, _, _ = next(
            dist.rendezvous(request.init_method, request.rank, request.world_size, timeout=timeout)
        )
        return store
    host, port = _host_port(request, url)
    agent_serves = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )
    is_master = request.rank == 0 and not agent_serves
    try:
        return dist.TCPStore(
            host,
            port,
            request.world_size,
            is_master=is_master,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, dist.DistError) as exc:
        if is_master:
            raise
        raise InitTimeoutError(
            f"rank {request.rank} could not reach the rendezvous store at {host}:{port} within "
            f"{request.init_timeout_s:g} s: rank 0, which hosts it, never arrived (or MASTER_ADDR "
            "/ MASTER_PORT point elsewhere)",
            missing_ranks=[0],
            address=f"{host}:{port}",
            timeout=request.init_timeout_s,
        ) from exc


def _host_port(request: InitRequest, url) -> tuple[str, int]:
    if url.scheme == "tcp":
        if url.hostname is None or url.port is None:
            raise ValueError(f"init_method {request.init_method!r} needs tcp://HOST:PORT")
        return url.hostname, url.port
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"init_method env:// needs {' and '.join(missing)} in the environment "
            "(torchrun sets them), or pass init_method='tcp://HOST:PORT'"
        )
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def announce(store: dist.Store, request: InitRequest) -> None:
    """Register this rank's arrival; read back by :func:`missing_ranks` only on a timeout.

    No barrier here: process-group construction waits for every rank anyway, and an extra
    all-ranks round through the store costs milliseconds of scheduling on a busy host.
    """
    store.set(_ARRIVED.format(rank=request.rank), str(os.getpid()))


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


def missing_ranks(store: dist.Store, world_size: int) -> list[int] | None:
    """Ranks whose arrival key is not in ``store`` now; None when the store cannot be read.

    Reads through a clone (its own connection): the initialising thread may be blocked in a
    wait on the original, and a store client serves one request at a time.
    """
    try:
        reader = store.clone()
        return [
            rank for rank in range(world_size) if not reader.check([_ARRIVED.format(rank=rank)])
        ]
    except (RuntimeError, dist.DistError):
        return None
