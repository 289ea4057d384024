"""Whether a dense attention backend or sparse kernel forced by name can run here, before any call.

A kernel forced by name is never replaced by another, so one that cannot run raises; without
this module it would raise at the first forward, after a model load. ``BoostManager`` and
``liteboost generate``'s preflight both refuse it up front through :func:`check_forced`, which
applies the plug-in registry's own constraints to the calls the run can make, so the check up
front and the choice at the call follow one rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from liteboost import env
from liteboost.attention.backends import ATTENTION_BACKENDS, AttentionCall, forced_backend
from liteboost.ops.sparse_kernels import SPARSE_KERNELS, SparseCall
from npu_core.device import detect_backend
from npu_core.plugins import Registry

CallT = TypeVar("CallT")

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""dtypes a boosted model may compute attention in: ``model.to(dtype)`` after boosting changes
it, so a forced kernel is refused up front only when no dtype would do; a call in a dtype the
kernel does not take still raises at the call, with the reason."""


def check_forced(
    registry: Registry[Any, CallT], name: str, calls: Sequence[CallT], source: str
) -> None:
    """Raise unless the plug-in ``name`` of ``registry`` can take at least one of ``calls``.

    Args:
        registry: the attention backends or the sparse kernels.
        name: the forced plug-in.
        calls: the calls the run can make, likeliest first (at least one).
        source: the argument or option that forced it, named in the message.

    Raises:
        ValueError: ``{source}={name!r} cannot run here: {why}; usable here: {names}``, where
            ``why`` is the registry's reason for each refused call (duplicates dropped) and
            ``names`` the plug-ins that can take one of ``calls``. An unknown ``name`` raises
            ``npu_core.plugins.PluginError`` (a ValueError) listing the registered names.
    """
    if not calls:
        raise ValueError("check_forced needs at least one call to judge")
    registry.get(name)
    rejections = [registry.rejections(call) for call in calls]
    if any(reasons[name] is None for reasons in rejections):
        return
    why = "; ".join(dict.fromkeys(str(reasons[name]) for reasons in rejections))
    usable = [n for n in registry.names() if any(r[n] is None for r in rejections)]
    raise ValueError(
        f"{source}={name!r} cannot run here: {why}; usable here: {', '.join(usable) or 'none'}"
    )


def model_devices(module: torch.nn.Module) -> list[str]:
    """Device types ``module``'s attention may run on: where its weights are, then this
    machine's accelerator (models are often moved or offloaded there after boosting)."""
    weight = next(module.parameters(), None)
    devices = [weight.device.type if weight is not None else "cpu"]
    accelerator = detect_backend().value
    if accelerator not in devices:
        devices.append(accelerator)
    return devices


def check_boost_kernels(
    module: torch.nn.Module, attention_backend: str | None, sparse_kernel: str | None
) -> None:
    """Refuse a forced dense backend (argument or ``LITEBOOST_ATTENTION_BACKEND``) or sparse
    kernel that no call of ``module`` can run on here.

    Judged on each device of :func:`model_devices` in each float dtype, with the head dim from
    the model's ``config.attention_head_dim`` (a model without one leaves the dense backend to
    its first call).

    Raises:
        ValueError: as :func:`check_forced`, naming the argument (or the variable) and value.
    """
    head_dim = getattr(getattr(module, "config", None), "attention_head_dim", None)
    backend = None if head_dim is None else forced_backend(attention_backend)
    if backend is None and sparse_kernel is None:
        return  # nothing forced: the chains choose per call, and no device is probed
    devices = model_devices(module)
    if backend is not None and head_dim is not None:
        source = "attention_backend" if attention_backend is not None else env.ATTENTION_BACKEND
        dense = [
            AttentionCall.on(d, dtype, int(head_dim)) for d in devices for dtype in _MODEL_DTYPES
        ]
        check_forced(ATTENTION_BACKENDS, backend.value, dense, source)
    if sparse_kernel is not None:
        sparse = [SparseCall(d, dtype, forced=True) for d in devices for dtype in _MODEL_DTYPES]
        check_forced(SPARSE_KERNELS, sparse_kernel, sparse, "sparse_kernel")
