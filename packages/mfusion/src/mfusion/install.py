"""Attach mfusion to Inductor's post-grad stage (and, for the chunked cross-entropy, its joint
forward+backward stage) so plain ``torch.compile(model)`` runs it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch._inductor.config as inductor_config

from mfusion.backends.registry import BackendName, get_backend
from mfusion.config import MFusionConfig
from mfusion.joint.chunked_ce import ChunkedCrossEntropyPass
from mfusion.passes.manager import MFusionPassManager

_LOCK = threading.Lock()
_PREVIOUS: list[tuple[Any, Any]] = []
"""Per :func:`install`: the post-grad and joint-graph passes it replaced."""


def install(
    backend: BackendName | str = BackendName.AUTO,
    passes: Sequence[str] | None = None,
    auto_fuse: bool = True,
    **options: Any,
) -> MFusionPassManager:
    """Register mfusion as ``torch._inductor.config.post_grad_custom_post_pass``.

    Args:
        backend: Kernel backend for auto-fused regions (``auto``, ``inductor``, ``mlir-cpu``,
            ``npu``).
        passes: Hand-written passes to run, in order; None runs all of them.
        auto_fuse: Plan (and, for kernel-generating backends, outline) fusion regions.
        **options: Further :class:`~mfusion.config.MFusionConfig` fields.

    Returns:
        The installed pass manager.

    Raises:
        RuntimeError: Another custom post-grad pass (or, with ``chunked_cross_entropy``, joint
            pass) is installed; mfusion does not silently replace it.
    """
    config = MFusionConfig(
        backend=backend,
        passes=tuple(passes) if passes is not None else None,
        auto_fuse=auto_fuse,
        **options,
    )
    get_backend(config.resolved_backend())  # fail here, not in the middle of a compile
    manager = MFusionPassManager(config)
    with _LOCK:
        current = inductor_config.post_grad_custom_post_pass
        if current is not None and not isinstance(current, MFusionPassManager):
            raise RuntimeError(
                f"post_grad_custom_post_pass already holds {current!r}; remove it before "
                "mfusion.install() (mfusion does not chain foreign passes)"
            )
        joint = inductor_config.joint_custom_pre_pass
        foreign_joint = joint is not None and not isinstance(joint, ChunkedCrossEntropyPass)
        if config.chunked_cross_entropy and foreign_joint:
            raise RuntimeError(
                f"joint_custom_pre_pass already holds {joint!r}; remove it before "
                "mfusion.install(chunked_cross_entropy=True)"
            )
        _PREVIOUS.append((current, joint))
        inductor_config.post_grad_custom_post_pass = manager
        if config.chunked_cross_entropy:
            inductor_config.joint_custom_pre_pass = ChunkedCrossEntropyPass(config)
    return manager


def compile_options(
    backend: BackendName | str = BackendName.AUTO,
    passes: Sequence[str] | None = None,
    auto_fuse: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Inductor options that run mfusion for one ``torch.compile`` call only.

    ``torch.compile(model, options=mfusion.compile_options())`` scopes mfusion to that compiled
    model, leaving the global config untouched (useful to compare with and without mfusion).
    """
    config = MFusionConfig(
        backend=backend,
        passes=tuple(passes) if passes is not None else None,
        auto_fuse=auto_fuse,
        **options,
    )
    get_backend(config.resolved_backend())
    inductor_options: dict[str, Any] = {"post_grad_custom_post_pass": MFusionPassManager(config)}
    if config.chunked_cross_entropy:
        inductor_options["joint_custom_pre_pass"] = ChunkedCrossEntropyPass(config)
    return inductor_options


def uninstall() -> None:
    """Restore the post-grad pass that was there before the matching :func:`install`."""
    with _LOCK:
        if not isinstance(inductor_config.post_grad_custom_post_pass, MFusionPassManager):
            raise RuntimeError("mfusion is not installed")
        post_grad, joint = _PREVIOUS.pop() if _PREVIOUS else (None, None)
        inductor_config.post_grad_custom_post_pass = post_grad
        inductor_config.joint_custom_pre_pass = joint


def is_installed() -> bool:
    return isinstance(inductor_config.post_grad_custom_post_pass, MFusionPassManager)


@contextlib.contextmanager
def enabled(
    backend: BackendName | str = BackendName.AUTO,
    passes: Sequence[str] | None = None,
    auto_fuse: bool = True,
    **options: Any,
) -> Iterator[MFusionPassManager]:
    """``with mfusion.enabled(): torch.compile(model)(x)`` — installed only inside the block.

    Inductor compiles lazily on the first call, so call the compiled model inside the block.
    """
    manager = install(backend, passes, auto_fuse, **options)
    try:
        yield manager
    finally:
        uninstall()
