"""The background thread: rendezvous, default process group, then queued sub-groups."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from mccl import gate
from mccl._rendezvous import (
    announce,
    connect_store,
    missing_ranks,
    store_address,
    timeout_error,
)
from mccl.config import InitRequest
from mccl.errors import InitTimeoutError

# When init_timeout passes with every rank arrived, process-group construction is still
# connecting: it gets this much longer before the first use gives up on it.
STALL_GRACE_S = 10.0


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
        self._store: dist.Store | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._queued: list[GroupFuture] = []
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="mccl-init", daemon=True)

    def start(self) -> None:
        gate.install(self)
        self._thread.start()

    def is_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; True when finished (successfully or not)."""
        return self._done.wait(timeout)

    def wait_for_use(self) -> None:
        """Called by the gate: block until ready, re-raise a failure, never wait forever.

        At ``init_timeout`` the arrival keys in the store name any rank that never came.
        """
        if not self._done.wait(max(self.deadline - time.monotonic(), 0.0)):
            store = self._store
            missing = None if store is None else missing_ranks(store, self.request.world_size)
            if missing:
                raise timeout_error(self.request, missing)
            if not self._done.wait(STALL_GRACE_S):
                raise self._stall_error()
        if self.error is not None:
            raise self.error

    def enqueue_group(self, kwargs: dict[str, Any]) -> GroupFuture | None:
        """Queue a sub-group for creation right after the default group; None if too late."""
        with self._lock:
            if not self._accepting:
                return None
            future = GroupFuture(kwargs)
            self._queued.append(future)
            return future

    def _run(self) -> None:
        # Hand the GIL straight back: the caller is blocked in Thread.start() until it gets it,
        # and would otherwise wait out a whole switch interval (5 ms) behind our Python code.
        time.sleep(0)
        request = self.request
        try:
            self._store = connect_store(request)
            announce(self._store, request)
            dist.init_process_group(
                request.backend,
                store=self._store,
                rank=request.rank,
                world_size=request.world_size,
                timeout=request.timeout,
            )
            self._create_queued_groups()
        except BaseException as exc:
            self.error = exc
            self._fail_queued_groups(exc)
        finally:
            self.finished_at = time.monotonic()
            self._done.set()  # wake waiters first; the gates let them through from now on
            if self.error is None:
                gate.release(self)

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
            missing: list[int] = []
        else:
            missing = missing_ranks(self._store, request.world_size)
            if missing is None:
                detail, missing = f"the rendezvous store at {address} closed", []
            elif missing:
                detail = f"ranks {missing} never arrived at {address}"
            else:
                detail = (
                    f"every rank arrived at {address} but {request.backend} process-group "
                    "construction did not finish"
                )
        return InitTimeoutError(
            f"mccl initialisation of rank {request.rank} did not finish within "
            f"{request.init_timeout_s:g} s: {detail}",
            missing_ranks=missing,
            address=address,
            timeout=request.init_timeout_s,
        )
