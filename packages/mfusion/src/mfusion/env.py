"""Every environment variable mfusion reads, in one place (no other module touches them).

Values are read when asked for, never at import, so tests and launchers can set them late.
"""

from __future__ import annotations

from pathlib import Path

from npu_core.env import read, user_cache_root

CACHE_DIR = "MFUSION_CACHE_DIR"
"""Folder of mfusion's measured decisions (default ``$XDG_CACHE_HOME/mfusion``); whether they are
measured at all follows ``NPU_CORE_DECISIONS`` (``npu_core.env``)."""

MLIR_CHOICE = "MFUSION_MLIR_CHOICE"
"""How a region picks MLIR or Inductor: ``measure`` (default), ``always`` or ``never``."""


def cache_root() -> Path:
    """``$MFUSION_CACHE_DIR``, else ``mfusion`` under the user's cache root
    (``npu_core.env.user_cache_root``: ``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    root = read(CACHE_DIR)
    return Path(root) if root is not None else user_cache_root() / "mfusion"


def mlir_choice() -> str:
    """``MFUSION_MLIR_CHOICE`` lower-cased, ``measure`` when unset (the caller checks the value)."""
    return (read(MLIR_CHOICE) or "measure").lower()
