"""``checkpoint_exclude_wrapper``: a module or function inside a checkpointed region that is
never recomputed; decided once at its boundary, with no per-op policy calls inside."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar, overload

from torch import nn

from hyperparallel.activation.region import Phase, current_region

M = TypeVar("M", bound=nn.Module)
P = ParamSpec("P")
R = TypeVar("R")


def _excluded(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        region = current_region()
        if region is None or region.excluding:
            return fn(*args, **kwargs)
        if region.phase is Phase.REPLAY:
            return region.replay_excluded()
        with region.excluded():
            out = fn(*args, **kwargs)
        region.store_excluded(out)
        return out

    return call


@overload
def checkpoint_exclude_wrapper(module_or_fn: M) -> M: ...


@overload
def checkpoint_exclude_wrapper(module_or_fn: Callable[P, R]) -> Callable[P, R]: ...


def checkpoint_exclude_wrapper(
    module_or_fn: nn.Module | Callable[P, R],
) -> nn.Module | Callable[P, R]:
    """Keep the outputs and saved tensors of ``module_or_fn`` when it runs inside a region.

    In forward the region's policy is suspended for the whole call (its dispatch mode is popped,
    so the call's ops are not even observed) and everything it saves stays on device; its
    outputs are stored, and the region's replay returns them instead of running it. Use it for
    expensive or communication-heavy parts of a checkpointed block (an all-to-all, attention).
    Outside any region the wrapped callable behaves exactly as before.

    Args:
        module_or_fn: a module (its ``forward`` is wrapped in place; the module is returned) or
            a function (a wrapped function is returned).
    """
    if isinstance(module_or_fn, nn.Module):
        if "forward" in module_or_fn.__dict__:
            raise ValueError(f"{type(module_or_fn).__name__} already has an instance forward")
        module_or_fn.forward = _excluded(module_or_fn.forward)
        return module_or_fn
    if not callable(module_or_fn):
        raise TypeError(
            f"checkpoint_exclude_wrapper needs a module or a callable, got {module_or_fn!r}"
        )
    return _excluded(module_or_fn)
