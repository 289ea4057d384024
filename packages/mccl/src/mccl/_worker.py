"""The background thread: rendezvous, default process group, then queued sub-groups.

A failure is decided once and kept: every later use re-raises the same exception at once.

The thread never stays inside a long C++ store call while peers are missing, and is stopped and
joined at interpreter exit. A store call cannot be interrupted from Python, and one that returns
while the interpreter finalises (its timeout, or the store's host exiting and closing the
connection) re-acquires the GIL from pybind11; CPython then ends the thread with pthread_exit,
whose forced unwind through that noexcept destructor aborts the whole process with "terminate
called without an active exception". Making the thread a daemon does not help; only having it
out of C++ before finalisation does.
"""

from __future__ import annotations

import atexit
import datetime
import re
import threading
import time
import weakref
from types import TracebackType
from typing import Any

import torch.distributed as dist

# torch.distributed re-exports these without declaring them (no `as`, not in __all__)
from torch._C._distributed_c10d import Store

from mccl import gate
from mccl._rendezvous import (
    POLL_S,
    announce,
    await_arrivals,
    connect_store,
    store_address,
)
from mccl.config import InitRequest
from mccl.errors import InitTimeoutError, MCCLError

STALL_GRACE_S = 10.0
"""When every rank has arrived, construction of a process group that is not bounded by
``init_timeout`` (any backend but gloo) may run this much past it before the first use gives up
on it (its NCCL/HCCL connections are still being made)."""

EXIT_JOIN_S = STALL_GRACE_S
"""Longest wait at interpreter exit for the thread. Waiting for peers it leaves within one check
or connection attempt (under 0.5 s); only process-group construction, once every rank has
arrived, can take longer (gloo's ends at ``init_timeout``)."""

_GLOO_KEY_RANK = re.compile(r"/(\d+)$")

_workers: weakref.WeakSet[InitWorker] = weakref.WeakSet()


class GroupFuture:
    """A sub-group requested with :func:`mccl.new_group`; ``wait()`` returns the ProcessGroup."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self._done = threading.Event()
        self._group: Any = None
        self._error: BaseException | None = None

    def _resolve(self, group: Any = None, error: BaseException | None = None) -> None:
        self._group, self._error = group, error
        self._done.set()

    def done(self) -> bool:
        """Whether the group was created (or its creation failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the group exists and return it; re-raise its creation error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"sub-group {self.kwargs} not created within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._group


class InitWorker:
    """Runs one asynchronous initialisation and answers the gate's questions about it."""

    def __init__(self, request: InitRequest) -> None:
        self.request = request
        self.started_at = time.monotonic()
        self.deadline = self.started_at + request.init_timeout_s
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self._error_tb: TracebackType | None = None
        self._store: Store | None = None
        self._all_arrived = False
        self._missing: list[int] | None = None  # ranks not yet arrived, once listed
        self._settled = threading.Event()  # the outcome (ready or failed) is known
        self._stop = threading.Event()  # asks the thread to leave its waits for peers
        self._lock = threading.Lock()
        self._queued: list[GroupFuture] = []
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="mccl-init", daemon=True)

    def start(self) -> None:
        gate.install(self)
        _workers.add(self)
        self._thread.start()

    def is_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def done(self) -> bool:
        """Whether the outcome is known: ready, or failed (then for good)."""
        return self._settled.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; True when the outcome is known."""
        return self._settled.wait(timeout)

    def wait_for_use(self) -> None:
        """Called by the gate: block until ready, re-raise a failure, never wait forever.

        The thread itself reports absent ranks at ``init_timeout``; past it only construction
        with every rank present can still be running, and it gets :data:`STALL_GRACE_S`.
        """
        if not self._settled.is_set():
            limit = self.deadline + STALL_GRACE_S - time.monotonic()
            if not self._settled.wait(max(limit, 0.0)):
                self._settle(self._stall_error())
        self.raise_if_failed()

    def _set_missing(self, ranks: list[int]) -> None:
        self._missing = list(ranks)

    def waiting_for(self) -> str | None:
        """What the initialisation waits for now, in words; None once it has finished."""
        if self.done():
            return None
        request, address = self.request, store_address(self.request)
        if self._store is None:
            return f"the rendezvous store at {address} (hosted by rank 0)"
        if not self._all_arrived:
            missing = self._missing
            count = request.world_size - 1 if missing is None else len(missing)
            return f"{count} more rank{'s' if count != 1 else ''} at {address}"
        return f"{request.backend} process-group construction with every rank at {address}"

    def raise_if_failed(self) -> None:
        """Re-raise the recorded failure, with the traceback it was recorded with."""
        error = self.error
        if error is not None:
            # Re-raising appends frames to __traceback__; restore it so repeated uses (torch's
            # c10d_logger calls is_initialized() while handling the first) do not pile them up.
            raise error.with_traceback(self._error_tb)

    def stop_and_join(self, timeout: float) -> bool:
        """Ask the thread to stop waiting for peers and join it; True when it has ended."""
        self._stop.set()
        if self._thread.is_alive() and not self.is_worker_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def enqueue_group(self, kwargs: dict[str, Any]) -> GroupFuture | None:
        """Queue a sub-group for creation right after the default group; None if too late."""
        with self._lock:
            if not self._accepting:
                return None
            future = GroupFuture(kwargs)
            self._queued.append(future)
            return future

    def _settle(self, error: BaseException | None) -> bool:
        """Record the outcome once (the first caller wins); True if this call recorded it."""
        with self._lock:
            if self._settled.is_set():
                return False
            self.error = error
            self._error_tb = None if error is None else error.__traceback__
            self.finished_at = time.monotonic()
            self._settled.set()  # wake waiters; after success the gates let them through
        if error is not None:
            self._stop.set()
            self._fail_queued_groups(error)
        return True

    def _run(self) -> None:
        # Hand the GIL straight back: the caller is blocked in Thread.start() until it gets it,
        # and would otherwise wait out a whole switch interval (5 ms) behind our Python code.
        time.sleep(0)
        request = self.request
        try:
            self._store = connect_store(request, self.deadline, self._stop)
            announce(self._store, request)
            await_arrivals(self._store, request, self.deadline, self._stop, self._set_missing)
            self._all_arrived = True
            self._construct()
            self._create_queued_groups()
        except BaseException as exc:
            self._settle(exc)
        else:
            if self._settle(None):
                gate.release(self)

    def _construct(self) -> None:
        """Build the default process group; gloo's connection set-up ends at the deadline.

        gloo connects its full mesh inside the constructor, waiting on the store for each
        peer's address with the process group's collective timeout (30 min by default), not
        the store's. A rank that exits after announcing itself would hold the others there
        long past ``init_timeout`` (measured: 15 s for ``init_timeout=5``, the whole
        :data:`STALL_GRACE_S`, then a 10 s join at exit). So gloo is built with the time left
        and given the collective timeout right after. Other backends are left as they are:
        NCCL/HCCL connect lazily, and their timeout also arms a watchdog.
        """
        request = self.request
        bounded = _is_gloo(request.backend)
        timeout = request.timeout
        if bounded:
            left = max(self.deadline - time.monotonic(), POLL_S)
            timeout = min(timeout, datetime.timedelta(seconds=left))
        try:
            dist.init_process_group(
                request.backend,
                store=self._store,
                rank=request.rank,
                world_size=request.world_size,
                timeout=timeout,
            )
        except dist.DistStoreError as exc:
            if not bounded:
                raise
            raise self._construction_error(str(exc)) from None
        if timeout != request.timeout:
            _set_group_timeout(request.timeout)

    def _construction_error(self, torch_message: str) -> MCCLError:
        """gloo's store wait timed out: name the ranks whose addresses never appeared."""
        request = self.request
        address = store_address(request)
        keys = torch_message.partition("keys:")[2].split(",")
        ranks = sorted(
            {int(m.group(1)) for key in keys if (m := _GLOO_KEY_RANK.search(key.strip()))}
        )
        who = f"ranks {ranks}" if ranks else "some ranks"
        return InitTimeoutError(
            f"every rank arrived at the rendezvous store {address}, but {who} of "
            f"{request.world_size} did not join gloo's connection set-up within "
            f"{request.init_timeout_s:g} s (seen from rank {request.rank}); they exited or "
            "stopped after arriving",
            missing_ranks=ranks,
            address=address,
            timeout=request.init_timeout_s,
        )

    def _create_queued_groups(self) -> None:
        # Every rank queues the same groups in the same order, so creating them here, in order,
        # keeps new_group's collective ordering intact; the lock closes the queue atomically.
        while True:
            with self._lock:
                if not self._queued:
                    self._accepting = False
                    return
                future = self._queued.pop(0)
            future._resolve(dist.new_group(**future.kwargs))

    def _fail_queued_groups(self, exc: BaseException) -> None:
        with self._lock:
            self._accepting = False
            queued, self._queued = self._queued, []
        for future in queued:
            future._resolve(error=exc)

    def _stall_error(self) -> InitTimeoutError:
        request = self.request
        address = store_address(request)
        if self._store is None:
            detail = f"the rendezvous store at {address} was not reached"
        elif not self._all_arrived:
            detail = f"the ranks did not all register at {address}"
        else:
            detail = (
                f"every rank arrived at {address} but {request.backend} process-group "
                "construction did not finish"
            )
        return InitTimeoutError(
            f"mccl initialisation of rank {request.rank} did not finish within "
            f"{request.init_timeout_s:g} s (+{STALL_GRACE_S:g} s): {detail}",
            missing_ranks=[],
            address=address,
            timeout=request.init_timeout_s,
        )


def _is_gloo(backend: str) -> bool:
    """Whether every device of ``backend`` (``gloo``, ``cpu:gloo``) is served by gloo."""
    return all(part.split(":")[-1].strip().lower() == "gloo" for part in backend.split(","))


def _set_group_timeout(timeout: datetime.timedelta) -> None:
    """Give the default group its collective timeout (called on the initialising thread)."""
    group = dist.distributed_c10d.GroupMember.WORLD
    if group is None:  # only called once init_process_group has returned
        raise MCCLError("the default process group is gone before its timeout could be set")
    if hasattr(group, "set_timeout"):  # newer torch; older releases only have _set_pg_timeout
        group.set_timeout(timeout)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


@atexit.register
def _stop_at_exit() -> None:
    # atexit handlers run before finalisation freezes daemon threads: the last moment at which
    # the thread can still leave its store call and end cleanly (see the module docstring).
    for worker in list(_workers):
        worker.stop_and_join(EXIT_JOIN_S)
