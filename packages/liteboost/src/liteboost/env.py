"""Environment variables liteboost reads, in one place (read when asked, never at import).

This module is the only one in liteboost that touches the environment; reading goes through
:func:`npu_core.env.read` (stripped value, unset and empty alike are None), as in every package.
"""

from __future__ import annotations

import os

from npu_core.env import read

__all__ = ["ATTENTION_BACKEND", "PATH", "TORCH_EXTENSIONS_DIR", "VARIABLES", "prepend_path", "read"]

ATTENTION_BACKEND = "LITEBOOST_ATTENTION_BACKEND"
"""Force the dense attention backend: ``fa3``, ``fa2``, ``npu`` or ``sdpa`` (default: chain)."""

PATH = "PATH"
"""Executable search path: torch's extension builder runs the ``ninja`` it finds there."""

TORCH_EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"
"""torch's root folder for compiled extensions; liteboost builds its CPU extension under it too
(default: torch's ``get_default_build_root()``, ``~/.cache/torch_extensions``)."""

VARIABLES = (ATTENTION_BACKEND, PATH, TORCH_EXTENSIONS_DIR)
"""Every variable liteboost reads (the README lists them)."""


def prepend_path(directory: str) -> None:
    """Put ``directory`` first on ``PATH`` for this process and the tools it starts."""
    current = read(PATH)
    os.environ[PATH] = directory if current is None else f"{directory}{os.pathsep}{current}"
