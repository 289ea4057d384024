"""Shared fixtures: a per-session Inductor cache, tracing helpers for pass tests."""

from __future__ import annotations

import os
import tempfile

import pytest

# One fresh Inductor cache per test session: runs never read another run's artefacts, and the
# second compile of a test still exercises the FX cache lookup (with mfusion's uuid in the key).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mfusion-inductor-"))


@pytest.fixture(autouse=True)
def _fresh_report():
    import mfusion

    mfusion.clear_report()
    yield
    while mfusion.is_installed():
        mfusion.uninstall()
