"""The forward's random-number and autocast state, captured as a region starts and restored
around its replay, so that dropout and autocast decide exactly as they did in forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


class ForwardState:
    """CPU and device RNG states and autocast settings at the start of a region's forward.

    Args:
        tensors: the region's tensor inputs; their devices are the ones whose RNG is captured
            (the first non-CPU device type found, as ``torch.utils.checkpoint`` does).
        preserve_rng_state: capture RNG states; False skips it when the region draws nothing.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], preserve_rng_state: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.device_type = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
        self._cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self._device_rng = (
            get_device_states(*tensors) if preserve_rng_state and self.device_type else None
        )
        self._autocast = {
            dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in {"cpu", self.device_type or "cpu"}
        }

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run a block with the forward's RNG and autocast state; the caller's RNG state is
        put back afterwards, so a replay draws nothing from the training's random stream."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._rng())
            for device_type, (enabled, dtype) in self._autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype, enabled=enabled))
            yield

    @contextlib.contextmanager
    def _rng(self) -> Iterator[None]:
        if not self.preserve_rng_state:
            yield
            return
        assert self._cpu_rng is not None
        cpu_now = torch.get_rng_state()
        device_now = None
        if self._device_rng:
            # The devices captured in forward (the inputs may since have moved to host).
            devices = self._device_rng[0]
            probes = [torch.empty(0, device=f"{self.device_type}:{d}") for d in devices]
            device_now = get_device_states(*probes)
        torch.set_rng_state(self._cpu_rng)
        if self._device_rng:
            set_device_states(*self._device_rng, device_type=self.device_type)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if device_now:
                set_device_states(*device_now, device_type=self.device_type)
