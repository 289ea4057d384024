"""Muon for hidden weight matrices, AdamW for everything else, behind one optimizer object.

Routing is decided once from the module tree and parameter names; the two inner optimizers keep
their own state, and their param groups are shared (same dicts) so LR schedulers drive both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hyperparallel.optim.muon import Muon

Route = Literal["muon", "adamw"]
Classifier = Callable[[str, Tensor], str | None]
"""(name, param) -> "muon", "adamw", or None to fall back to the default rule."""

_ROUTES: tuple[Route, ...] = ("muon", "adamw")
_ADAMW_NAME_PARTS = ("embed", "lm_head", "output")


class HybridOptimizer(torch.optim.Optimizer):
    """One optimizer over a Muon and an AdamW that own disjoint parameters.

    ``param_groups`` holds the inner optimizers' group dicts themselves (Muon's first), so a
    scheduler that sets ``group["lr"]`` changes the inner optimizer's step. Per-parameter state
    lives in ``.muon.state`` and ``.adamw.state``.

    Attributes:
        muon: The Muon optimizer, or None when no parameter was routed to it.
        adamw: The AdamW optimizer, or None when no parameter was routed to it.
        routing: Parameter name -> "muon" or "adamw", in model order.
    """

    def __init__(
        self,
        muon: Muon | None,
        adamw: torch.optim.Optimizer | None,
        routing: dict[str, Route] | None = None,
    ) -> None:
        """Wrap two built optimizers.

        Args:
            muon: Optimizer of the matrix parameters, or None.
            adamw: Optimizer of the remaining parameters, or None.
            routing: Name -> route, kept for reporting.

        Raises:
            ValueError: Both optimizers are None.
        """
        if muon is None and adamw is None:
            raise ValueError("HybridOptimizer needs at least one of muon and adamw; both are None")
        self.muon = muon
        self.adamw = adamw
        self.routing: dict[str, Route] = dict(routing or {})
        self._initialised = False
        super().__init__(self._inner_groups(), defaults={})
        self._initialised = True

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self._inner() for group in opt.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Register an inner optimizer's group; refused after construction.

        Raises:
            ValueError: Called after construction, where the new group would never be stepped.
        """
        if self._initialised:
            raise ValueError(
                "HybridOptimizer.add_param_group is not supported: the group would belong to "
                "neither inner optimizer. Build a new optimizer with get_hyper_optimizer instead"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step Muon, then AdamW; the closure runs once, before both.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter of both optimizers."""
        for opt in self._inner():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"muon": ..., "adamw": ...}``, each the inner optimizer's state dict or None."""
        return {
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` from an optimizer with the same routing.

        Raises:
            ValueError: The dict's keys, or which sides are present, do not match this optimizer.
        """
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                f"HybridOptimizer state dict has keys {sorted(state_dict)}; expected "
                "['adamw', 'muon']"
            )
        for side in _ROUTES:
            opt, saved = getattr(self, side), state_dict[side]
            if (opt is None) != (saved is None):
                saved_has = "has" if saved is not None else "has no"
                self_has = "has a" if opt is not None else "has no"
                raise ValueError(
                    f"HybridOptimizer state dict {saved_has} {side} state but this optimizer "
                    f"{self_has} {side} side; did the model or its routing change?"
                )
            if opt is not None:
                opt.load_state_dict(saved)
        # torch's load_state_dict replaces the inner group dicts; share the new ones again.
        self.param_groups[:] = self._inner_groups()


def classify_parameter(
    name: str, param: Tensor, aliases: set[str], embedding_ids: set[int], norm_ids: set[int]
) -> Route:
    """The default route of one parameter.

    AdamW gets what Muon's orthogonal update does not suit: 0-D/1-D tensors (biases, norm
    scales), embeddings (rows are looked up, not multiplied), the output head, and parameters
    of normalisation modules. Names are matched on substrings, so a hidden layer named e.g.
    ``attention.output.dense`` also goes to AdamW; pass ``classify`` to override.

    Args:
        name: The parameter's canonical name.
        param: The parameter.
        aliases: Every name the parameter has (tied weights have several).
        embedding_ids: ``id`` of every ``nn.Embedding`` weight.
        norm_ids: ``id`` of every parameter owned by a module whose class name has "Norm".
    """
    if param.ndim < 2 or id(param) in embedding_ids or id(param) in norm_ids:
        return "adamw"
    names = aliases | {name}
    if any(part in alias for alias in names for part in _ADAMW_NAME_PARTS):
        return "adamw"
    return "muon"


def route_parameters(model: nn.Module, classify: Classifier | None = None) -> dict[str, Route]:
    """Name -> "muon" or "adamw" for every parameter of ``model`` (tied ones once).

    A final ``nn.Linear`` tied to an embedding shares the embedding's tensor, so it follows the
    embedding to AdamW.

    Raises:
        ValueError: ``classify`` returned something other than "muon", "adamw" or None.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norm_ids = {
        id(p)
        for m in model.modules()
        if "Norm" in type(m).__name__
        for p in m.parameters(recurse=False)
    }
    aliases: dict[int, set[str]] = {}
    for alias, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(alias)
    routing: dict[str, Route] = {}
    for name, p in model.named_parameters():
        choice = classify(name, p) if classify is not None else None
        if choice is None:
            routing[name] = classify_parameter(name, p, aliases[id(p)], embedding_ids, norm_ids)
        elif choice in _ROUTES:
            routing[name] = choice
        else:
            raise ValueError(
                f"classify returned {choice!r} for parameter {name!r}; it must return 'muon', "
                "'adamw' or None (default rule)"
            )
    return routing


def _check_adamw(kwargs: dict[str, Any]) -> None:
    """Refuse non-finite AdamW hyperparameters, which torch.optim.AdamW accepts."""
    for key in ("lr", "eps", "weight_decay", "betas"):
        if key not in kwargs:
            continue
        value = kwargs[key]
        numbers = value if isinstance(value, tuple | list) else (value,)
        for number in numbers:
            if isinstance(number, Tensor):
                number = number.item() if number.numel() == 1 else math.nan
            if isinstance(number, bool) or not isinstance(number, int | float):
                raise ValueError(f"adamw: {key}={value!r} is invalid; it must be a number")
            if not math.isfinite(number):
                raise ValueError(f"adamw: {key}={value!r} is invalid; it must be finite")


def get_hyper_optimizer(
    model: nn.Module,
    muon: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
    classify: Classifier | None = None,
) -> HybridOptimizer:
    """Build Muon for the hidden matrices of ``model`` and AdamW for the rest.

    Args:
        model: The model; every parameter is routed, including frozen ones (they get no grads
            and are skipped by both optimizers).
        muon: Keyword arguments of :class:`Muon`.
        adamw: Keyword arguments of ``torch.optim.AdamW``.
        classify: Optional ``(name, param) -> "muon" | "adamw" | None`` run before the default
            rule (:func:`classify_parameter`); None keeps the default for that parameter.

    Returns:
        The combined optimizer; a side with no parameters is None.

    Raises:
        ValueError: ``model`` has no parameters, ``classify`` returned an invalid route, or a
            hyperparameter is out of range (AdamW's own checks let ``lr=inf`` through, which
            turns every weight non-finite at the first step).
    """
    routing = route_parameters(model, classify)
    if not routing:
        raise ValueError(f"{type(model).__name__} has no parameters to optimise")
    params = dict(model.named_parameters())
    sides: dict[str, list[tuple[str, Tensor]]] = {route: [] for route in _ROUTES}
    for name, route in routing.items():
        sides[route].append((name, params[name]))
    _check_adamw(adamw or {})
    muon_opt = Muon(sides["muon"], **(muon or {})) if sides["muon"] else None
    adamw_opt = torch.optim.AdamW(sides["adamw"], **(adamw or {})) if sides["adamw"] else None
    return HybridOptimizer(muon_opt, adamw_opt, routing)
