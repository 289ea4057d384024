"""Make torch.distributed wait for a pending background initialisation at first use.

Rather than wrapping dozens of collectives, we gate the two functions every collective, query,
``new_group``, DeviceMesh and FSDP2 path goes through to find the default group:
``distributed_c10d._get_default_group`` and ``is_initialized``. They are replaced in every loaded
``torch.distributed`` module that holds them (some import them by name), and restored as soon as
the initialisation succeeds, so a ready job runs the original functions with zero overhead.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed.distributed_c10d as c10d

GATED_NAMES = ("_get_default_group", "is_initialized")
_ORIGINALS: dict[str, Callable[..., Any]] = {name: getattr(c10d, name) for name in GATED_NAMES}
_lock = threading.Lock()
_pending: _Pending | None = None


class _Pending(Protocol):
    def is_worker_thread(self) -> bool: ...
    def wait_for_use(self) -> None: ...


def _make_gate(name: str) -> Callable[..., Any]:
    original = _ORIGINALS[name]

    @functools.wraps(original)
    def gate(*args: Any, **kwargs: Any) -> Any:
        pending = _pending
        if pending is not None and not pending.is_worker_thread():
            pending.wait_for_use()
        return original(*args, **kwargs)

    gate.__mccl_gate__ = True  # type: ignore[attr-defined]
    return gate


_GATES = {name: _make_gate(name) for name in GATED_NAMES}


def _torch_distributed_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None
        and (name == "torch.distributed" or name.startswith("torch.distributed."))
    ]


def _swap(old: dict[str, Callable[..., Any]], new: dict[str, Callable[..., Any]]) -> None:
    for module in _torch_distributed_modules():
        for name in GATED_NAMES:
            if getattr(module, name, None) is old[name]:
                setattr(module, name, new[name])


def install(pending: _Pending) -> None:
    """Gate torch.distributed on ``pending`` until :func:`release` is called."""
    global _pending
    with _lock:
        _pending = pending
        _swap(_ORIGINALS, _GATES)


def release(pending: _Pending) -> None:
    """Restore the original functions, if ``pending`` is still the one gating."""
    global _pending
    with _lock:
        if _pending is not pending:
            return
        _pending = None
        _swap(_GATES, _ORIGINALS)


def is_installed() -> bool:
    """Whether torch.distributed is currently gated."""
    return _pending is not None
