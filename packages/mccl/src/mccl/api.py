"""Public entry points: start initialisation in the background, wait for it, ask about it."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from mccl import config, gate
from mccl._worker import GroupFuture, InitWorker
from mccl.errors import MCCLError

_current: InitWorker | None = None


class InitHandle:
    """The result of :func:`init_process_group`: a future for the default process group."""

    def __init__(self, worker: InitWorker | None) -> None:
        self._worker = worker

    @property
    def is_async(self) -> bool:
        """False when the stock blocking path ran (``async_init=False``)."""
        return self._worker is not None

    def done(self) -> bool:
        """Whether initialisation has finished, successfully or not."""
        return self._worker is None or self._worker.done()

    def exception(self) -> BaseException | None:
        """The background failure, if initialisation finished with one."""
        return None if self._worker is None else self._worker.error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the default process group is ready.

        Args:
            timeout: seconds to wait; None waits as long as the initialisation's own
                ``init_timeout`` allows (it then fails by itself, naming absent ranks).

        Raises:
            TimeoutError: ``timeout`` passed first (initialisation keeps going).
            Exception: the background failure, re-raised with its original traceback; once
                initialisation has failed, every call raises that same exception at once.
        """
        if self._worker is None:
            return
        if timeout is None:
            self._worker.wait_for_use()
            return
        if not self._worker.wait(timeout):
            raise TimeoutError(f"process group not ready within {timeout:g} s (still initialising)")
        self._worker.raise_if_failed()

    def waiting_for(self) -> str | None:
        """What initialisation is waiting for, for a caller to report while it waits (e.g.
        ``"1 more rank at 127.0.0.1:29500"``); None once finished, or for the blocking path."""
        return None if self._worker is None else self._worker.waiting_for()

    def elapsed(self) -> float | None:
        """Seconds the background initialisation took, or None while it runs (or if sync)."""
        worker = self._worker
        if worker is None or worker.finished_at is None:
            return None
        return worker.finished_at - worker.started_at


def init_process_group(
    backend: str | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    init_timeout: float | datetime.timedelta | None = None,
    async_init: bool = True,
) -> InitHandle:
    """Initialise the default process group on a background thread and return at once.

    Rendezvous (store, address exchange) and process-group construction overlap whatever the
    caller does next, typically device initialisation and model build. Any torch.distributed call
    that needs the group (collectives, ``barrier``, ``new_group``, ``get_rank``, DeviceMesh, FSDP2)
    blocks until it is ready, or re-raises the background failure.

    Args:
        backend: ``gloo``, ``nccl``, ``hccl``... (default: ``npu_core.device.comm_backend()``).
        init_method: ``env://`` (default: torchrun's MASTER_ADDR / MASTER_PORT), ``tcp://HOST:PORT``
            or any URL torch.distributed.rendezvous accepts.
        rank: this process's rank (default: ``RANK``).
        world_size: number of ranks (default: ``WORLD_SIZE``).
        timeout: collective timeout of the process group, seconds or timedelta (torch default).
        init_timeout: how long every rank may take to arrive (default: ``MCCL_INIT_TIMEOUT`` or
            300 s); past it the first use raises InitTimeoutError naming the absent ranks.
        async_init: False (or ``MCCL_ASYNC_INIT=0``) runs torch's blocking initialisation.

    Raises:
        ValueError: an argument or environment variable is missing or out of range.
        MCCLError: an initialisation is already running or done.
    """
    global _current
    if _current is not None and not _current.done():
        raise MCCLError("mccl.init_process_group is already running; call mccl.wait() first")
    if _original_is_initialized():
        raise MCCLError("the default process group is already initialised")
    request = config.resolve_request(backend, init_method, rank, world_size, timeout, init_timeout)
    if not config.async_init_enabled(async_init):
        _current = None
        dist.init_process_group(
            request.backend,
            init_method=request.init_method,
            rank=request.rank,
            world_size=request.world_size,
            timeout=request.timeout,
        )
        return InitHandle(None)
    if _current is not None:  # a previous attempt failed: stop its gate before starting over
        gate.release(_current)
    _current = InitWorker(request)
    _current.start()
    return InitHandle(_current)


def _original_is_initialized() -> bool:
    return dist.distributed_c10d.GroupMember.WORLD is not None


def wait(timeout: float | None = None) -> None:
    """Wait for the initialisation started by :func:`init_process_group` (see InitHandle.wait)."""
    if _current is None:
        if _original_is_initialized():
            return
        raise MCCLError("nothing to wait for: call mccl.init_process_group first")
    InitHandle(_current).wait(timeout)


def is_ready() -> bool:
    """Whether the default process group exists and is usable; never blocks."""
    if _current is not None and (not _current.done() or _current.error is not None):
        return False
    return _original_is_initialized()


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> GroupFuture:
    """Request a sub-group without blocking; it is created, in request order, once init is done.

    Every rank must request the same groups in the same order (as with ``dist.new_group``).
    Keyword arguments go to ``torch.distributed.new_group``.

    Returns:
        A GroupFuture: ``.wait()`` returns the ProcessGroup.
    """
    kwargs = {"ranks": ranks, **kwargs}
    future = _current.enqueue_group(kwargs) if _current is not None else None
    if future is None:
        future = GroupFuture(kwargs)
        try:
            future._resolve(dist.new_group(**kwargs))
        except Exception as exc:
            future._resolve(error=exc)
    return future
