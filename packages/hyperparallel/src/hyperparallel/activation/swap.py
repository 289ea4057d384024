"""Swapping tensor storage to pinned host memory on a side copy stream, and bringing it back.

A :class:`SwappedStorage` copies one whole storage (so every view of it can be rebuilt exactly)
to a host buffer from a shared :class:`~npu_core.memory.HostBufferPool`; once the caller drops the
device tensor, the device memory is free. :meth:`SwappedStorage.prefetch` starts the copy back on
the side stream; :meth:`SwappedStorage.view` waits for it only when the data is needed. On CPU the
streams of :mod:`npu_core.streams` are synchronous stand-ins and "host" is the same memory as
"device": the copy out is made (the same code path as on accelerators), the copy back is not
needed, and swapping changes where the bytes are accounted, not where they live.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from hyperparallel.activation.observers import (
    ObservedRegion,
    pop_observer,
    push_observer,
)
from npu_core import streams
from npu_core.memory import HostBufferPool


class SwapEngine:
    """One side copy stream per device and one pool of (pinned) host buffers, made on first use."""

    def __init__(self) -> None:
        self.pool = HostBufferPool()
        self._streams: dict[torch.device, streams.Stream] = {}

    def stream(self, device: torch.device) -> streams.Stream:
        """The side stream copies to and from ``device`` run on."""
        if device not in self._streams:
            self._streams[device] = streams.new_stream(device)
        return self._streams[device]


_ENGINE = SwapEngine()


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """All bytes of ``tensor``'s storage as a flat uint8 tensor (shares memory)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


class SwappedStorage:
    """A tensor's whole storage, copied to host; the device copy can be freed by the caller.

    The copy starts on construction (asynchronous on accelerators). ``source`` is kept only as a
    weak reference, to detect an in-place modification after the copy: autograd's own version
    check is bypassed once saved-tensor hooks are installed, so this one replaces it.
    """

    def __init__(
        self, source: torch.Tensor, what: Callable[[], str], engine: SwapEngine | None = None
    ) -> None:
        self.engine = engine or _ENGINE
        self.device = source.device
        self.what = what
        device_bytes = _byte_view(source)
        self.nbytes = device_bytes.numel()
        self.host = self.engine.pool.acquire(self.nbytes, torch.uint8)
        self._offloaded = streams.copy_async(
            device_bytes, self.host, self.engine.stream(self.device)
        )
        self._source = weakref.ref(source)
        self._version = source._version
        self._restored: torch.Tensor | None = None
        self._restored_event: streams.Event | None = None

    def check_version(self) -> None:
        """Raise if the swapped tensor, still alive somewhere, was modified in place since.

        Raises:
            RuntimeError: naming the tensor and both versions.
        """
        source = self._source()
        if source is not None and source._version != self._version:
            raise RuntimeError(
                f"{self.what()} was swapped to host for backward and then modified in place "
                f"(version {self._version} -> {source._version}); backward would use stale "
                "values. Clone it before modifying it, or mark its producing op MUST_SAVE."
            )

    def prefetch(self) -> None:
        """Start copying back to the device on the side stream (no-op if already started).

        On a CPU device the host buffer already is device memory, so it is used as is; the
        buffer returns to the pool only when this object dies, after every view of it.
        """
        if self._restored is not None:
            return
        if self.device.type == "cpu":
            self._restored, self._restored_event = self.host, self._offloaded
            return
        stream = self.engine.stream(self.device)
        streams.wait_event(stream, self._offloaded)
        restored = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._restored_event = streams.copy_async(self.host, restored, stream)
        self._restored = restored

    @property
    def prefetched(self) -> bool:
        """Whether the copy back has been started."""
        return self._restored is not None

    def view(self, like: TensorMeta) -> torch.Tensor:
        """The device tensor described by ``like`` over the restored storage (waits for it)."""
        self.check_version()
        self.prefetch()
        assert self._restored is not None and self._restored_event is not None
        if self.device.type != "cpu":
            streams.wait_event(streams.current_stream(self.device), self._restored_event)
        out = torch.empty(0, dtype=like.dtype, device=self.device)
        out.set_(self._restored.untyped_storage(), like.offset, like.size, like.stride)
        return out

    def __del__(self) -> None:
        # Graph freed (backward done or abandoned): the host buffer goes back to the pool once
        # the copy that fills it has finished.
        with contextlib.suppress(Exception):
            self._offloaded.synchronize()
            self.engine.pool.release(self.host)


class TensorMeta(NamedTuple):
    """Enough to rebuild a tensor (or a view) over a storage: dtype, size, stride, offset."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int | torch.SymInt  # what storage_offset() returns (symbolic when traced)
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The layout of ``tensor`` relative to its storage."""
        return cls(
            tensor.dtype,
            tensor.shape,
            tensor.stride(),
            tensor.storage_offset(),
            tensor.requires_grad,
        )


@dataclass
class SwapSchedule:
    """When region inputs leave the device and when swapped data comes back.

    Use as a context manager around one step's forward and backward. Regions created inside
    register in forward order.

    Args:
        offload_after: 0 offloads a region's inputs as soon as its forward returns; ``n >= 1``
            pairs the offload with the forward of the region ``n`` places later, so the copy
            overlaps that region's compute; the last ``n`` regions keep their inputs on device,
            which backward needs first anyway.
        prefetch_ahead: when backward reaches region ``k`` (a hook on the gradient of its
            outputs), start copying back everything swapped by regions ``k-1 .. k-ahead``; 0
            copies back only on demand, when backward unpacks a swapped tensor.
        recompute_ahead: at the same moment, recompute regions ``k-1 .. k-ahead`` (early
            recompute: on an accelerator it can overlap region ``k``'s gradient communication);
            their backward reuses the results.
    """

    offload_after: int = 0
    prefetch_ahead: int = 1
    recompute_ahead: int = 0

    schedules_offload: ClassVar[bool] = True
    """Regions leave input offloading to this schedule (see :class:`RegionObserver`)."""

    def __post_init__(self) -> None:
        for name in ("offload_after", "prefetch_ahead", "recompute_ahead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        self._regions: list[weakref.ref[ObservedRegion]] = []
        self._token: contextvars.Token | None = None

    def __enter__(self) -> SwapSchedule:
        self._regions.clear()
        self._token = push_observer(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        pop_observer(self._token)

    def region_started(self, region: ObservedRegion) -> None:
        """Called by a region as its forward begins: offload inputs that were waiting for it."""
        if self.offload_after:
            index = len(self._regions) - self.offload_after
            if index >= 0 and (earlier := self._regions[index]()) is not None:
                earlier.offload_inputs()
        self._regions.append(weakref.ref(region))

    def region_finished(self, region: ObservedRegion) -> None:
        """Called by a region as its forward returns."""
        if self.offload_after == 0:
            region.offload_inputs()

    def wants_backward_hook(self, region: ObservedRegion) -> bool:
        """Backward must report ``region`` when it has host copies to prefetch or when regions
        are recomputed ahead."""
        wanted = region.swaps_anything or self.recompute_ahead > 0
        return wanted and self.needs_backward_hook

    def backward_reached(self, region: ObservedRegion) -> None:
        """Called from a hook on region outputs' gradients: prefetch the regions before it."""
        refs = [r() for r in self._regions]
        if region not in refs:
            return
        k = refs.index(region)
        for earlier in refs[max(0, k - self.prefetch_ahead) : k]:
            if earlier is not None:
                earlier.prefetch()
        for earlier in refs[max(0, k - self.recompute_ahead) : k]:
            if earlier is not None:
                earlier.recompute_now()

    @property
    def needs_backward_hook(self) -> bool:
        """Whether regions must report when backward reaches them."""
        return self.prefetch_ahead > 0 or self.recompute_ahead > 0
