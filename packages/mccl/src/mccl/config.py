"""Resolve ``init_process_group``'s arguments (falling back on :mod:`mccl.env`) and check them.

Everything is resolved in the caller's thread, so a bad argument raises at the call instead of
later, at first use, from the background thread.
"""

from __future__ import annotations

import datetime

from pydantic import Field

from mccl import env
from npu_core.config import StrictConfig

DEFAULT_INIT_TIMEOUT_S = 300.0


def async_init_enabled(requested: bool) -> bool:
    """The argument, unless ``MCCL_ASYNC_INIT`` turns asynchronous initialisation off."""
    return requested and env.async_init() is not False


def _seconds(value: float | datetime.timedelta, name: str) -> float:
    """``value`` in seconds; refuses what is not a positive, finite number (``True`` included)."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(
            f"{name} must be seconds (a number) or a datetime.timedelta, got {value!r}"
        )
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds


class InitRequest(StrictConfig):
    """Everything the background initialisation needs, resolved in the caller's thread.

    Resolving early means a bad argument raises at the call, not later at first use.
    """

    backend: str = Field(description="Collective backend, as torch.distributed names it.")
    init_method: str = Field(description="Rendezvous URL: env://, tcp://HOST:PORT, file://...")
    rank: int = Field(ge=0, description="This process's rank.")
    world_size: int = Field(ge=1, description="Number of ranks.")
    timeout: datetime.timedelta = Field(description="Collective timeout of the process group.")
    init_timeout_s: float = Field(gt=0, description="Seconds every rank may take to arrive.")


def resolve_request(
    backend: str | None,
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float | datetime.timedelta | None,
    init_timeout: float | datetime.timedelta | None,
) -> InitRequest:
    """Fill defaults from arguments, then torchrun's environment, then npu_core's detection."""
    from npu_core.device import comm_backend

    init_method = init_method or "env://"
    rank = _int_from(rank, env.RANK, "rank")
    world_size = _int_from(world_size, env.WORLD_SIZE, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if init_timeout is None:
        from_env = env.init_timeout()
        init_timeout_s = DEFAULT_INIT_TIMEOUT_S
        if from_env is not None:
            init_timeout_s = _seconds(from_env, env.INIT_TIMEOUT)
    else:
        init_timeout_s = _seconds(init_timeout, "init_timeout")
    pg_timeout = (
        None if timeout is None else datetime.timedelta(seconds=_seconds(timeout, "timeout"))
    )
    return InitRequest(
        backend=_check_backend(str(backend or comm_backend().value)),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=pg_timeout or datetime.timedelta(minutes=30),
        init_timeout_s=init_timeout_s,
    )


def _check_backend(backend: str) -> str:
    """Refuse a backend torch.distributed does not know, here rather than as an AssertionError
    from deep inside process-group creation on the background thread.

    Accepts one name (``"gloo"``) or torch's per-device form (``"cpu:gloo,cuda:nccl"``); the
    known names are torch's ``Backend.backend_list``, which includes backends registered by
    extensions (``hccl`` once torch_npu is imported), and ``hccl`` itself.
    """
    import torch.distributed as dist

    known = sorted((set(dist.Backend.backend_list) | {"hccl"}) - {"undefined", "fake"})
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"backend={backend!r} is not a torch.distributed backend; use one of "
            f"{', '.join(known)} (or 'cpu:gloo,cuda:nccl'), or leave it out to use the detected one"
        )
    return backend


def _int_from(value: int | None, variable: str, argument: str) -> int:
    if value is not None:
        return int(value)
    from_env = env.integer(variable)
    if from_env is None:
        raise ValueError(
            f"{argument} was not given and {variable} is not set: pass {argument}=... "
            "or start the process with torchrun"
        )
    return from_env
