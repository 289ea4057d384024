"""BoostManager: apply (and remove) the single-device boosts to a model or a pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field, field_validator

from liteboost._components import components
from liteboost.attention.backends import parse_backend
from liteboost.cache import apply_cache, cache_config
from liteboost.forced_kernels import check_boost_kernels
from liteboost.models.registry import Handle, find_boost, supported_boosts, unsupported
from liteboost.ops.rain_fusion import SparseKernel
from npu_core.config import StrictConfig


class BoostConfig(StrictConfig):
    """Single-device boost settings, validated on construction (each is a CLI option too)."""

    sparsity: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of key blocks skipped in self-attention (0 = dense).",
    )
    rope_cache: bool = Field(
        True, description="Cache RoPE tables per grid, dtype and device and rotate in fp32."
    )
    attention_backend: str | None = Field(
        None, description='Dense backend "fa3", "fa2", "npu" or "sdpa"; None = first usable.'
    )
    block_size: int = Field(128, ge=1, description="Tokens per sparse-attention block.")
    sparse_kernel: str | None = Field(
        None,
        description='Sparse kernel "npu", "cpu", "gather", "flex" or "reference"; None: by device.',
    )

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        return None if value is None else parse_backend(value).value

    @field_validator("sparse_kernel")
    @classmethod
    def _known_kernel(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return SparseKernel(value).value
        except ValueError:
            allowed = ", ".join(k.value for k in SparseKernel)
            raise ValueError(f"{value!r} is not a sparse kernel; use one of: {allowed}") from None


_OWNER_ATTR = "_liteboost_boost_owner"


def _refuse_boosted(name: str, module: Any) -> None:
    """A component boosted twice would get a second set of hooks: say so, with the fix."""
    if getattr(module, _OWNER_ATTR, None) is not None:
        raise ValueError(
            f"{name} ({type(module).__name__}) is already boosted by another BoostManager; "
            "call remove() on that one (or leave its with-block) before boosting again"
        )


@dataclass
class _BoostedComponent:
    """One component's boost and optional cache, removed in reverse order."""

    module: Any
    parts: list

    def __post_init__(self) -> None:
        setattr(self.module, _OWNER_ATTR, self)

    def remove(self) -> None:
        while self.parts:
            self.parts.pop().remove()
        if getattr(self.module, _OWNER_ATTR, None) is self:
            delattr(self.module, _OWNER_ATTR)


class BoostManager:
    """Applies liteboost's single-device boosts in place; ``remove()`` (or ``with``) undoes them.

    Example:
        >>> manager = BoostManager(pipe, sparsity=0.8)  # doctest: +SKIP
        >>> video = pipe(prompt, num_frames=81).frames  # doctest: +SKIP
        >>> manager.remove()  # doctest: +SKIP

    Args:
        model_or_pipeline: a supported model (``liteboost.supported_boosts()``) or a diffusers
            pipeline holding at least one.
        sparsity: share of self-attention key blocks skipped, in [0, 1); 0 = dense attention.
        rope_cache: cache RoPE tables and rotate with one complex multiply.
        attention_backend: "fa3", "fa2", "npu" or "sdpa"; None = first usable (or the
            ``LITEBOOST_ATTENTION_BACKEND`` environment variable). A forced backend is checked
            here against the model's device, this machine's accelerator and the model's head
            dim (``liteboost.forced_kernels``); a call in a dtype it does not take raises.
        block_size: tokens per sparse block (128 matches the NPU kernel).
        sparse_kernel: "npu", "cpu", "gather", "flex" or "reference"; None = per device (NPU op,
            the fused "cpu" kernel on CPU, else flex). A forced kernel is checked here like
            ``attention_backend``.
        cache: step caching through diffusers' cache hooks on every boosted transformer: a
            diffusers cache config (``FirstBlockCacheConfig(threshold=0.1)``, ...) or a name
            ("first_block", "pab", "taylorseer"); None = off. Composes with sparse attention
            and with ``ParallelManager`` (see ``liteboost.cache``).
        cache_threshold: first-block cache threshold for ``cache="first_block"``.

    Raises:
        UnsupportedModelError: nothing in ``model_or_pipeline`` is supported; lists what is.
        ValueError: a setting is out of range (the message names it and what is allowed), a
            forced attention backend or sparse kernel cannot run on any device this model can
            use here (the message names the argument, the reason and what is usable), or a
            component is already boosted by another BoostManager.
    """

    def __init__(
        self,
        model_or_pipeline: object,
        sparsity: float = 0.0,
        rope_cache: bool = True,
        attention_backend: str | None = None,
        *,
        block_size: int = 128,
        sparse_kernel: str | None = None,
        cache: object | None = None,
        cache_threshold: float | None = None,
    ) -> None:
        is_module = isinstance(model_or_pipeline, torch.nn.Module)
        self.cache = (
            None
            if cache is None
            else cache_config(cache, None if is_module else model_or_pipeline, cache_threshold)
        )
        self.config = BoostConfig.validate_tree(
            {
                "sparsity": sparsity,
                "rope_cache": rope_cache,
                "attention_backend": attention_backend,
                "block_size": block_size,
                "sparse_kernel": sparse_kernel,
            }
        )
        self.handles: dict[str, Handle] = {}
        found = [(name, m, find_boost(m)) for name, m in components(model_or_pipeline)]
        targets = [(name, m, plan) for name, m, plan in found if plan is not None]
        if not targets:
            raise unsupported(model_or_pipeline, "boost", supported_boosts())
        for name, module, _ in targets:
            check_boost_kernels(module, self.config.attention_backend, self.config.sparse_kernel)
            _refuse_boosted(name, module)
        try:
            for name, module, plan in targets:
                handle = _BoostedComponent(module, [plan(module, self.config)])
                self.handles[name] = handle
                if self.cache is not None and hasattr(module, "enable_cache"):
                    handle.parts.append(apply_cache(module, self.cache))
        except BaseException:
            self.remove()
            raise

    @property
    def boosted(self) -> list[str]:
        """Names of the boosted components (``"model"`` for a bare model)."""
        return list(self.handles)

    def remove(self) -> None:
        """Restore the stock processors and hooks of every boosted component."""
        while self.handles:
            _, handle = self.handles.popitem()
            handle.remove()

    def __enter__(self) -> BoostManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
