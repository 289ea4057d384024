"""Dense attention backends and the chain FA3 -> FA2 -> NPU -> torch SDPA, checked per call.

Each backend declares what it accepts (device, dtype, head dim, CUDA compute capability) and its
native layout, as diffusers' attention dispatcher does. The backends are plug-ins of one
``npu_core.plugins.Registry``, chosen by the rule the sparse kernels follow too
(``liteboost.ops.sparse_kernels``): a call goes to the first backend in chain order that is
installed (its package imports; probed once per process) *and* whose constraints accept the
call. So fp32 inputs never reach FlashAttention (fp16/bf16 only), a head dim above 256 or a
pre-Ampere GPU falls back to SDPA, and CPU tensors always run SDPA, whatever is installed. Each
distinct choice is logged once.

``LITEBOOST_ATTENTION_BACKEND`` or a ``backend=`` argument forces one backend; a forced backend
that is not installed, or that does not accept the call, raises (naming what it accepts)
instead of silently falling back.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from liteboost import env
from npu_core.npu import import_torch_npu
from npu_core.plugins import DeviceDtype, Plugin, Registry

logger = logging.getLogger(__name__)


class AttentionBackend(enum.StrEnum):
    """Dense attention kernels, in order of preference."""

    FA3 = "fa3"
    FA2 = "fa2"
    NPU = "npu"
    SDPA = "sdpa"


@dataclass(frozen=True)
class AttentionCall:
    """What the constraints look at: the facts of one call, not the tensors themselves.

    Attributes:
        device: device type of q, k and v ("cpu", "cuda", "npu", ...).
        dtype: their common dtype, None when they differ.
        head_dim: head dim of q and k.
        value_head_dim: head dim of v.
        capability: CUDA compute capability of the device, None off CUDA.
    """

    device: str
    dtype: torch.dtype | None
    head_dim: int
    value_head_dim: int
    capability: tuple[int, int] | None = None

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionCall:
        """Describe a call; q, k, v in either layout (the head dim is last in both)."""
        devices = {t.device for t in (q, k, v)}
        if len(devices) != 1:
            raise ValueError(f"q, k and v must be on one device; got {sorted(map(str, devices))}")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"q and k must have the same head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        device = q.device
        capability = _cuda_capability(device) if device.type == "cuda" else None
        dtypes = {t.dtype for t in (q, k, v)}
        return cls(
            device=device.type,
            dtype=dtypes.pop() if len(dtypes) == 1 else None,
            head_dim=q.shape[-1],
            value_head_dim=v.shape[-1],
            capability=capability,
        )

    @classmethod
    def on(cls, device: str, dtype: torch.dtype, head_dim: int) -> AttentionCall:
        """Describe the calls a model makes on ``device`` (a device type) without tensors: q, k
        and v of one ``dtype`` and ``head_dim``, the capability of the current CUDA device."""
        capability = _cuda_capability(torch.device(device)) if device == "cuda" else None
        return cls(device, dtype, head_dim, head_dim, capability)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability_of(index)


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability_of(index: int) -> tuple[int, int]:
    # A plain dict, filled by the first (eager) call: inside a torch.compile trace the lookup is
    # a guarded constant, where a cached driver query would be traced into.
    capability = _CAPABILITY.get(index)
    if capability is None:
        major, minor = torch.cuda.get_device_capability(index)
        capability = _CAPABILITY[index] = (major, minor)
    return capability


_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Constraints(DeviceDtype):
    """What a backend accepts: ``npu_core.plugins.DeviceDtype`` plus head dims and capability.

    Attributes:
        devices: device types it runs on; None for any.
        dtypes: dtypes it takes (q, k and v must share one).
        differentiable: whether it has a backward.
        max_head_dim: largest head dim; None for no limit.
        value_head_dim_equal: v must have q's head dim.
        min_capability: minimum CUDA compute capability (major, minor).
    """

    max_head_dim: int | None = None
    value_head_dim_equal: bool = False
    min_capability: tuple[int, int] | None = None

    def rejection(self, call: AttentionCall) -> str | None:
        """Why this backend cannot take ``call``, or None when it can."""
        if call.dtype is None and (self.devices is None or call.device in self.devices):
            return "q, k and v have different dtypes (allowed: one shared dtype)"
        reason = super().rejection(call)
        if reason is not None:
            return reason
        head_dims = {call.head_dim, call.value_head_dim}
        if self.max_head_dim is not None and max(head_dims) > self.max_head_dim:
            return f"head dim {max(head_dims)} (allowed: at most {self.max_head_dim})"
        if self.value_head_dim_equal and len(head_dims) > 1:
            return (
                f"v head dim {call.value_head_dim} differs from q/k head dim {call.head_dim} "
                "(allowed: equal)"
            )
        if self.min_capability is not None and (call.capability or (0, 0)) < self.min_capability:
            need = ".".join(map(str, self.min_capability))
            return f"CUDA compute capability {call.capability} (allowed: >= {need})"
        return None


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]
"""(q, k, v, scale) -> out, all in the backend's native layout."""


@dataclass(frozen=True)
class BackendSpec:
    """A backend's implementation: how to load its kernel and which layout it takes."""

    name: AttentionBackend
    load: Callable[[], Kernel | None]
    layout: str


ATTENTION_BACKENDS: Registry[BackendSpec, AttentionCall] = Registry("attention backend")
"""The dense backends; priority is the chain order FA3 -> FA2 -> NPU -> SDPA."""

_PRIORITY = {backend: 10 * (i + 1) for i, backend in enumerate(AttentionBackend)}


def _register(
    name: AttentionBackend, constraints: Constraints, layout: str
) -> Callable[[Callable[[], Kernel | None]], Callable[[], Kernel | None]]:
    """Register ``load`` (returns the kernel, or None when its package is missing) as ``name``."""

    def decorate(load: Callable[[], Kernel | None]) -> Callable[[], Kernel | None]:
        def installed() -> str | None:
            return None if _kernel(name) is not None else "its package is not importable"

        spec = BackendSpec(name, load, layout)
        ATTENTION_BACKENDS.register(
            Plugin(name.value, spec, constraints, installed=installed, priority=_PRIORITY[name])
        )
        return load

    return decorate


def _import(name: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(name), attr)
    except Exception as exc:  # broken CUDA extensions raise more than ImportError
        logger.debug("%s.%s unavailable: %s", name, attr, exc)
        return None


# FlashAttention 3 (Hopper build, ``flash_attn_interface``): sm90+, fp16/bf16, head dim <= 256.
@_register(
    AttentionBackend.FA3,
    Constraints(("cuda",), _HALF, max_head_dim=256, min_capability=(9, 0)),
    layout="BSND",
)
def _fa3_kernel() -> Kernel | None:
    fn = _import("flash_attn_interface", "flash_attn_func")
    if fn is None:
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        out = fn(q, k, v, softmax_scale=scale)
        return out[0] if isinstance(out, tuple) else out

    return run


# FlashAttention 2: Ampere (sm80) or newer, fp16/bf16, head dim <= 256, v head dim == q's.
@_register(
    AttentionBackend.FA2,
    Constraints(
        ("cuda",), _HALF, max_head_dim=256, value_head_dim_equal=True, min_capability=(8, 0)
    ),
    layout="BSND",
)
def _fa2_kernel() -> Kernel | None:
    fn = _import("flash_attn", "flash_attn_func")
    if fn is None:
        return None
    return lambda q, k, v, scale: fn(q, k, v, softmax_scale=scale)


# torch_npu's npu_fusion_attention: fp16/bf16 (as diffusers' NPU backend declares), head dim
# <= 512 per its documentation.
@_register(
    AttentionBackend.NPU,
    Constraints(("npu",), _HALF, max_head_dim=512, value_head_dim_equal=True),
    layout="BSND",
)
def _npu_kernel() -> Kernel | None:
    torch_npu = import_torch_npu()
    if torch_npu is None:
        return None
    op = torch_npu.npu_fusion_attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        heads = q.shape[2]
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        return op(q, k, v, heads, input_layout="BSND", scale=scale)[0]

    return run


@_register(AttentionBackend.SDPA, Constraints(None, _FLOATS), layout="BNSD")
def _sdpa_kernel() -> Kernel:
    return lambda q, k, v, scale: F.scaled_dot_product_attention(q, k, v, scale=scale)


def parse_backend(
    value: str | AttentionBackend, source: str = "attention_backend"
) -> AttentionBackend:
    """Validate a backend name; the error lists the allowed names."""
    try:
        return AttentionBackend(str(value).lower())
    except ValueError:
        allowed = ", ".join(b.value for b in AttentionBackend)
        raise ValueError(f"{source}={value!r} is not a backend; use one of: {allowed}") from None


@functools.cache
def _kernel(backend: AttentionBackend) -> Kernel | None:
    return ATTENTION_BACKENDS.get(backend.value).impl.load()


def installed_backends() -> frozenset[AttentionBackend]:
    """Backends whose package imports in this process (probed once)."""
    return frozenset(AttentionBackend(name) for name in ATTENTION_BACKENDS.installed())


def forced_backend(backend: str | AttentionBackend | None = None) -> AttentionBackend | None:
    """The backend forced by the argument, else by the environment variable; None = the chain."""
    if backend is not None:
        return parse_backend(backend)
    forced = env.read(env.ATTENTION_BACKEND)
    return None if forced is None else parse_backend(forced, env.ATTENTION_BACKEND)


def _presence(present: bool) -> Callable[[], str | None]:
    """An ``installed`` probe that reports ``present`` (tests describe machines)."""
    return lambda: None if present else "not present"


def _with_installed(installed: Collection[AttentionBackend]) -> Registry:
    """A copy of the registry whose installed set is ``installed`` (tests describe machines)."""
    view: Registry[BackendSpec, AttentionCall] = Registry(ATTENTION_BACKENDS.kind)
    for name in ATTENTION_BACKENDS.names():
        plugin = ATTENTION_BACKENDS.get(name)
        present = AttentionBackend(name) in installed
        view.register(replace(plugin, installed=_presence(present)))
    return view


def select_backend(
    call: AttentionCall,
    forced: AttentionBackend | None = None,
    installed: Collection[AttentionBackend] | None = None,
) -> AttentionBackend:
    """The backend a call runs on: ``forced`` if it accepts the call, else the chain's first.

    The rule is ``npu_core.plugins.Registry.select``'s, shared with the sparse kernels.

    Args:
        call: the call's device, dtype and head dims.
        forced: a backend that must be used (its refusal raises), or None for the chain.
        installed: backends whose package is present; None probes this process
            (:func:`installed_backends`). Tests pass their own.

    Raises:
        npu_core.plugins.PluginError: (a ValueError) ``forced`` is not installed or does not
            accept the call, or no backend does; the message says why for each.
    """
    registry = ATTENTION_BACKENDS if installed is None else _with_installed(installed)
    forced_name = None if forced is None else AttentionBackend(forced).value
    return AttentionBackend(registry.select(call, forced_name).name)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "BSND",
    scale: float | None = None,
    backend: str | AttentionBackend | None = None,
) -> torch.Tensor:
    """Dense, non-causal attention through the first backend that accepts the call.

    Args:
        q: [B, S, N, D] ("BSND") or [B, N, S, D] ("BNSD"); FlashAttention and the NPU op take
            fp16/bf16 only, so fp32 calls run SDPA.
        k: like ``q`` (same head count).
        v: like ``k``.
        layout: "BSND" or "BNSD", for inputs and output alike.
        scale: softmax scale; default ``D ** -0.5``.
        backend: force "fa3", "fa2", "npu" or "sdpa" for this call.

    Returns:
        The attention output in ``layout``.
    """
    if layout not in ("BSND", "BNSD"):
        raise ValueError(f"layout={layout!r} is not supported; use 'BSND' or 'BNSD'")
    forced = forced_backend(backend)
    chosen = select_backend(AttentionCall.of(q, k, v), forced)
    spec = ATTENTION_BACKENDS.get(chosen.value).impl
    if spec.layout != layout:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kernel = _kernel(chosen)
    if kernel is None:  # the chain chose an installed backend: its kernel loads
        raise RuntimeError(f"attention backend {chosen.value!r} failed to load its kernel")
    out = kernel(q, k, v, scale)
    return out.transpose(1, 2) if spec.layout != layout else out
