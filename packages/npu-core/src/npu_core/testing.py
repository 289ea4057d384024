"""pytest helpers shared by every package's tests: skips that say which device is missing."""

from __future__ import annotations

import pytest

from npu_core.device import Backend, is_available

requires_cuda = pytest.mark.skipif(
    not is_available(Backend.CUDA), reason="needs a CUDA device (none visible)"
)
requires_npu = pytest.mark.skipif(
    not is_available(Backend.NPU), reason="needs an Ascend NPU and torch_npu (none visible)"
)
requires_accelerator = pytest.mark.skipif(
    not (is_available(Backend.CUDA) or is_available(Backend.NPU)),
    reason="needs a CUDA device or an Ascend NPU (cpu only here)",
)
