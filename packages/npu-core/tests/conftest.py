"""Measured decisions in npu-core's tests take their fallbacks, in a fresh cache folder: no
outcome depends on this machine's speed, and nothing is written to the user's cache.

Tests of a measurement switch measuring back on and inject a fake timer
(``npu_core.timing.use_timer``).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("NPU_CORE_DECISIONS", "fallback")
os.environ.setdefault("NPU_CORE_CACHE_DIR", tempfile.mkdtemp(prefix="npu-core-decisions-"))
