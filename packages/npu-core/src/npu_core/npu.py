"""The only place that imports ``torch_npu``; it does so lazily, on first use.

Importing torch_npu registers the ``npu`` device with torch (``torch.npu``). It is an optional
dependency (the ``[npu]`` extra), so failure to import means "no NPU", never an error.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)


@functools.cache
def import_torch_npu() -> ModuleType | None:
    """Import torch_npu once per process; None when it is missing or broken."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises more than ImportError
        logger.debug("torch_npu unavailable: %s", exc)
        return None


def npu_device_count() -> int:
    """Number of visible Ascend NPUs (0 without torch_npu)."""
    if import_torch_npu() is None:
        return 0
    import torch

    try:
        return int(torch.npu.device_count())  # type: ignore[attr-defined]  # added by torch_npu
    except Exception as exc:
        logger.debug("torch.npu.device_count() failed: %s", exc)
        return 0
