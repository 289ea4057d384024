"""Every environment variable mfusion reads, in one place (no other module touches them).

Values are read when asked for, never at import, so tests and launchers can set them late.
"""

from __future__ import annotations

from pathlib import Path

from npu_core.env import read

CACHE_DIR = "MFUSION_CACHE_DIR"
"""Folder of mfusion's measured decisions (default ``$XDG_CACHE_HOME/mfusion``)."""

MLIR_CHOICE = "MFUSION_MLIR_CHOICE"
"""How a region picks MLIR or Inductor: ``measure`` (default), ``always`` or ``never``."""

XDG_CACHE_HOME = "XDG_CACHE_HOME"
"""Read, never set: the user's cache root (default ``~/.cache``), under which mfusion keeps its
decisions when ``MFUSION_CACHE_DIR`` is unset."""


def cache_root() -> Path:
    """``$MFUSION_CACHE_DIR``, else ``$XDG_CACHE_HOME/mfusion``, else ``~/.cache/mfusion``."""
    root = read(CACHE_DIR)
    if root is not None:
        return Path(root)
    xdg = read(XDG_CACHE_HOME)
    return Path(xdg or Path.home() / ".cache") / "mfusion"


def mlir_choice() -> str:
    """``MFUSION_MLIR_CHOICE`` lower-cased, ``measure`` when unset (the caller checks the value)."""
    return (read(MLIR_CHOICE) or "measure").lower()
