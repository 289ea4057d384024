"""Environment variables read by npu_core, in one place.

Every variable is read when asked for (not at import), so tests and launchers can set them late.
"""

from __future__ import annotations

import os
from pathlib import Path

BACKEND = "NPU_CORE_BACKEND"
"""Force the compute backend: ``npu``, ``cuda`` or ``cpu`` (default: detected)."""

COMM_BACKEND = "NPU_CORE_COMM_BACKEND"
"""Force the collective backend: ``hccl``, ``nccl`` or ``gloo`` (default: follows the backend)."""


CACHE_DIR = "NPU_CORE_CACHE_DIR"
"""Folder of measured decisions (default ``$XDG_CACHE_HOME/npu-core``, else
``~/.cache/npu-core``); packages that keep their own folder pass it to the decision cache."""

DECISIONS = "NPU_CORE_DECISIONS"
"""How measured decisions are taken: ``measure`` (default: cached answer, else time the
candidates now and cache the winner), ``cached`` (cached answers only, never time; a miss takes
the documented fallback) or ``fallback`` (never time, never read: the fallback everywhere)."""

XDG_CACHE_HOME = "XDG_CACHE_HOME"
"""Read, never set: the user's cache root (default ``~/.cache``)."""


def read(name: str) -> str | None:
    """Return the stripped value of ``name``, or None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def user_cache_root() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where every package keeps its cached files."""
    root = read(XDG_CACHE_HOME)
    return Path(root) if root is not None else Path.home() / ".cache"


def decisions_dir() -> Path:
    """``$NPU_CORE_CACHE_DIR``, else ``npu-core`` under :func:`user_cache_root`."""
    root = read(CACHE_DIR)
    return Path(root) if root is not None else user_cache_root() / "npu-core"


def decisions_mode() -> str:
    """``NPU_CORE_DECISIONS`` lower-cased, ``measure`` when unset (the caller checks the value)."""
    return (read(DECISIONS) or "measure").lower()


ATEN_CPU_CAPABILITY = "ATEN_CPU_CAPABILITY"
"""Read, never set: caps the vector ISA ATen dispatches to (e.g. ``avx2`` on an AVX-512 CPU)."""

ONEDNN_MAX_CPU_ISA = "ONEDNN_MAX_CPU_ISA"
"""Read, never set: caps oneDNN's ISA (CPU bf16 GEMMs, convolutions); stamped on benchmarks."""

OMP_NUM_THREADS = "OMP_NUM_THREADS"
"""Read, never set by npu_core: a user's explicit intra-op thread count per process."""

RANK = "RANK"
"""The global rank torchrun gives a process; the local launcher sets it for the ranks it starts."""

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each rank; all four present means the rank was started by a launcher."""


def torchrun_environment() -> bool:
    """Whether torchrun (or anything setting its variables) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def set_rank_environment(address: str, port: int, rank: int, world_size: int) -> None:
    """Give a locally launched rank the variables torchrun would (single node: local = global)."""
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def launch_rank() -> int:
    """This process's global rank under a distributed launch, 0 outside one."""
    value = read(RANK)
    return int(value) if value is not None and value.isdigit() else 0
