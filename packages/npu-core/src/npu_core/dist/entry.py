"""One entry for multi-rank CLIs: spawn local ranks, or join the job torchrun already started."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch

from npu_core import env
from npu_core.device import comm_backend
from npu_core.dist.launch import launch


def is_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or anything setting its variables)."""
    return env.torchrun_environment()


def run(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout: float = 1800.0,
    backend: str | None = "default",
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of the job and return the values this process can see.

    Under torchrun the current process is one rank: the process group is initialised from the
    environment (``env://``), ``fn`` runs here, and the result is ``[value]``. Otherwise ``nproc``
    local ranks are spawned through :func:`launch` and all their values are returned. A CLI built
    on this runs unchanged both ways, and so on many nodes.
    """
    if not is_torchrun():
        return launch(fn, nproc, *args, timeout=timeout, backend=backend)
    if backend == "default":
        backend = comm_backend().value
    owns_group = backend is not None and not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group(
            backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout)
        )
    try:
        return [fn(*args)]
    finally:
        if owns_group:
            torch.distributed.destroy_process_group()
