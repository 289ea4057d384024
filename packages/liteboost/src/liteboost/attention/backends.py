"""Dense attention backends and the chain FA3 -> FA2 -> NPU -> torch SDPA, chosen once.

The first backend that imports *and* runs on this process's device wins; the choice is logged
once. ``LITEBOOST_ATTENTION_BACKEND`` or a ``backend=`` argument overrides it; an override naming
a backend that cannot run here raises instead of silently falling back.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from liteboost import env
from npu_core import detect_backend
from npu_core._npu import import_torch_npu

logger = logging.getLogger(__name__)


class AttentionBackend(enum.StrEnum):
    """Dense attention kernels, in order of preference."""

    FA3 = "fa3"
    FA2 = "fa2"
    NPU = "npu"
    SDPA = "sdpa"


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]
"""(q, k, v, scale) -> out, all [B, S, N, D] (the layout FlashAttention and Wan use)."""


def _import(name: str, attr: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(name), attr)
    except Exception as exc:  # broken CUDA extensions raise more than ImportError
        logger.debug("%s.%s unavailable: %s", name, attr, exc)
        return None


def _fa3_kernel() -> Kernel | None:
    fn = _import("flash_attn_interface", "flash_attn_func")
    if fn is None or detect_backend() != "cuda":
        return None

    def run(q, k, v, scale):
        out = fn(q, k, v, softmax_scale=scale)
        return out[0] if isinstance(out, tuple) else out

    return run


def _fa2_kernel() -> Kernel | None:
    fn = _import("flash_attn", "flash_attn_func")
    if fn is None or detect_backend() != "cuda":
        return None
    return lambda q, k, v, scale: fn(q, k, v, softmax_scale=scale)


def _npu_kernel() -> Kernel | None:
    torch_npu = import_torch_npu()
    if torch_npu is None or detect_backend() != "npu":
        return None
    op = torch_npu.npu_fusion_attention

    def run(q, k, v, scale):
        heads = q.shape[2]
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        return op(q, k, v, heads, input_layout="BSND", scale=scale)[0]

    return run


def _sdpa_kernel() -> Kernel:
    def run(q, k, v, scale):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        )
        return out.transpose(1, 2)

    return run


_FACTORIES: dict[AttentionBackend, Callable[[], Kernel | None]] = {
    AttentionBackend.FA3: _fa3_kernel,
    AttentionBackend.FA2: _fa2_kernel,
    AttentionBackend.NPU: _npu_kernel,
    AttentionBackend.SDPA: _sdpa_kernel,
}


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
def _kernel_for(backend: AttentionBackend) -> Kernel:
    kernel = _FACTORIES[backend]()
    if kernel is None:
        raise RuntimeError(
            f"attention backend {backend.value!r} cannot run here (its package is not importable "
            f"or the device is {detect_backend().value}); use 'sdpa' or leave it unset"
        )
    return kernel


@functools.cache
def _chain_choice() -> AttentionBackend:
    for backend in AttentionBackend:
        if _FACTORIES[backend]() is not None:
            logger.info(
                "liteboost attention backend: %s (first usable of fa3, fa2, npu, sdpa)", backend
            )
            return backend
    raise AssertionError("unreachable: sdpa always works")


def resolve_backend(backend: str | AttentionBackend | None = None) -> AttentionBackend:
    """The backend a call uses: the argument, else the environment variable, else the chain."""
    if backend is not None:
        return parse_backend(backend)
    forced = env.read(env.ATTENTION_BACKEND)
    if forced is not None:
        return parse_backend(forced, env.ATTENTION_BACKEND)
    return _chain_choice()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "BSND",
    scale: float | None = None,
    backend: str | AttentionBackend | None = None,
) -> torch.Tensor:
    """Dense, non-causal attention through the chosen backend.

    Args:
        q: [B, S, N, D] ("BSND") or [B, N, S, D] ("BNSD"); fp32, bf16 or fp16 (FlashAttention
            and the NPU op need half precision).
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
    kernel = _kernel_for(resolve_backend(backend))
    if layout == "BNSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = kernel(q, k, v, scale)
    return out.transpose(1, 2) if layout == "BNSD" else out
