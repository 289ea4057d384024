"""Which model classes liteboost can boost or parallelise, looked up by class name.

Plans register themselves with ``@register_boost("ClassName")`` / ``@register_parallel``; the
built-in plans live in modules listed in ``_BUILTIN_PLANS`` and are imported on first lookup, so
importing liteboost initialises no model code and no device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

_BUILTIN_PLANS = ("liteboost.models.wan",)


class Handle(Protocol):
    """What applying a plan returns: something that undoes it."""

    def remove(self) -> None: ...


PlanFn = Callable[[torch.nn.Module, Any], Handle]
ParallelPlanFn = Callable[[torch.nn.Module, Any], Handle | None]
"""A parallel plan returns None when there is nothing to do (every degree 1, one rank)."""
_Fn = TypeVar("_Fn", PlanFn, ParallelPlanFn)

_BOOSTS: dict[str, PlanFn] = {}
_PARALLEL: dict[str, ParallelPlanFn] = {}


class UnsupportedModelError(TypeError):
    """No liteboost plan is registered for a model class."""


def _register(table: dict[str, _Fn], kind: str, class_name: str) -> Callable[[_Fn], _Fn]:
    def decorator(fn: _Fn) -> _Fn:
        if class_name in table and table[class_name] is not fn:
            raise ValueError(f"a {kind} plan for {class_name} is already registered")
        table[class_name] = fn
        return fn

    return decorator


def register_boost(class_name: str) -> Callable[[PlanFn], PlanFn]:
    """Register ``fn(model, settings) -> Handle`` as the single-device boost of ``class_name``."""
    return _register(_BOOSTS, "boost", class_name)


def register_parallel(class_name: str) -> Callable[[ParallelPlanFn], ParallelPlanFn]:
    """Register ``fn(model, runtime) -> Handle | None`` as the parallel plan of ``class_name``.

    ``runtime`` is a ``liteboost.parallel.ParallelRuntime``: the resolved ``ParallelConfig``
    plus the mesh and this rank's process groups.
    """
    return _register(_PARALLEL, "parallel", class_name)


def unregister_boost(class_name: str) -> None:
    """Remove the boost plan of ``class_name`` (a plan registered for an experiment or test)."""
    _BOOSTS.pop(class_name, None)


def unregister_parallel(class_name: str) -> None:
    """Remove the parallel plan of ``class_name``."""
    _PARALLEL.pop(class_name, None)


def _load_builtins() -> None:
    for module in _BUILTIN_PLANS:
        importlib.import_module(module)


def supported_boosts() -> list[str]:
    """Class names with a registered boost plan."""
    _load_builtins()
    return sorted(_BOOSTS)


def supported_parallel() -> list[str]:
    """Class names with a registered parallel plan."""
    _load_builtins()
    return sorted(_PARALLEL)


def _find(table: dict[str, _Fn], model: object) -> _Fn | None:
    _load_builtins()
    for cls in type(model).__mro__:
        if cls.__name__ in table:
            return table[cls.__name__]
    return None


def find_boost(model: object) -> PlanFn | None:
    """The boost plan for ``model``'s class (or a base class), None when there is none."""
    return _find(_BOOSTS, model)


def find_parallel(model: object) -> ParallelPlanFn | None:
    """The parallel plan for ``model``'s class (or a base class), None when there is none."""
    return _find(_PARALLEL, model)


def unsupported(model: object, kind: str, supported: list[str]) -> UnsupportedModelError:
    """The error for a model (or pipeline) with nothing to apply: it lists what is supported."""
    return UnsupportedModelError(
        f"liteboost has no {kind} plan for {type(model).__name__}; supported: "
        f"{', '.join(supported)} (or a pipeline holding one of them)"
    )
