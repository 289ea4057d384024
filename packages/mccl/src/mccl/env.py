"""Every environment variable mccl reads or sets, in one place (no other module touches them).

mccl's own switches (``MCCL_*``) and the launcher variables it follows (torchrun's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``). Values are
read when asked for, never at import, so launchers and tests can set them late.
"""

from __future__ import annotations

import os

from npu_core.env import read

ASYNC_INIT = "MCCL_ASYNC_INIT"
"""Set to 0 (or false / no / off) to make ``mccl.init_process_group`` the stock blocking path."""

INIT_TIMEOUT = "MCCL_INIT_TIMEOUT"
"""Default ``init_timeout`` in seconds (300 when unset)."""

RANK = "RANK"
"""This process's rank (torchrun); the default of ``rank=``."""

WORLD_SIZE = "WORLD_SIZE"
"""Number of ranks (torchrun); the default of ``world_size=``."""

MASTER_ADDR = "MASTER_ADDR"
"""Host of the rendezvous store for ``init_method="env://"``."""

MASTER_PORT = "MASTER_PORT"
"""Port of the rendezvous store for ``init_method="env://"``."""

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""``True`` under torchrun's elastic agent, which hosts the store itself: rank 0 then joins it
as a client instead of creating it."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def async_init() -> bool | None:
    """``MCCL_ASYNC_INIT`` as a boolean, or None when unset.

    Raises:
        ValueError: the value is not a boolean word; names the variable and the value.
    """
    value = read(ASYNC_INIT)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{ASYNC_INIT}={value!r} is not a boolean; use 0 or 1")


def init_timeout() -> float | None:
    """``MCCL_INIT_TIMEOUT`` in seconds, or None when unset.

    Raises:
        ValueError: the value is not a number; names the variable and the value.
    """
    value = read(INIT_TIMEOUT)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{INIT_TIMEOUT}={value!r} is not a number of seconds") from None


def integer(name: str) -> int | None:
    """An integer launcher variable (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``), None if unset.

    Raises:
        ValueError: the value is not an integer; names the variable and the value.
    """
    value = read(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def master_addr() -> str | None:
    """``MASTER_ADDR``, or None when unset."""
    return read(MASTER_ADDR)


def agent_serves_store() -> bool:
    """Whether torchrun's elastic agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return read(AGENT_STORE) == "True"


def set_rendezvous(addr: str, port: int, *, agent_store: bool) -> None:
    """Point ``env://`` at ``addr:port`` for this process, as torchrun would.

    The start-up benchmark uses it to make each round look like a torchrun job whose agent
    already hosts the store.
    """
    os.environ[MASTER_ADDR] = addr
    os.environ[MASTER_PORT] = str(port)
    os.environ[AGENT_STORE] = "True" if agent_store else "False"
