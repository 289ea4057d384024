"""Environment variables read by liteboost, in one place (read when asked, never at import)."""

from __future__ import annotations

import os

ATTENTION_BACKEND = "LITEBOOST_ATTENTION_BACKEND"
"""Force the dense attention backend: ``fa3``, ``fa2``, ``npu`` or ``sdpa`` (default: chain)."""


def read(name: str) -> str | None:
    """Return the stripped value of ``name``, or None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None
