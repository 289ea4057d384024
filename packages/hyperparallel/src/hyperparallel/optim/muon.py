"""Muon for hidden weight matrices: momentum, Newton-Schulz orthogonalisation, decoupled weight
decay. Plain tensors are orthogonalised here; DTensor parameters need a distributed engine attached
to :attr:`Muon._engine` (see ``optim/distributed.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from hyperparallel.optim import newton_schulz
from hyperparallel.optim.newton_schulz import CoefficientSpec, NsDtype

Engine = Callable[[list[Tensor], list[Tensor]], list[Tensor]]
"""(updates, params) -> orthogonalised updates, each shaped like its parameter."""

DEFAULT_COMM_BATCH_BYTES = 64 * 2**20
"""Whole-matrix bytes an owner receives per communication batch when no memory budget is set."""

ParamLabel = str | int
"""A parameter's name when the optimizer was given (name, tensor) pairs, else its flat index
(position over all param groups, the id ``state_dict()`` uses)."""

# Kernel settings shared by every group: one Newton-Schulz configuration lets all same-shape
# matrices of the model run as one batch. Group dicts that try to override them are refused.
_OPTIMIZER_WIDE = ("ns_steps", "ns_coefficients", "ns_dtype", "eps", "memory_budget_bytes")


class AdjustLR(enum.StrEnum):
    """How the step size is scaled by the matrix shape (M, N)."""

    ORIGINAL = "original"
    """lr * sqrt(max(1, M / N)), Keller Jordan's rule."""
    MATCH_RMS_ADAMW = "match_rms_adamw"
    """lr * matched_adamw_rms * sqrt(max(M, N)): update RMS like AdamW's, so AdamW's lr and weight
    decay carry over (Moonshot, "Muon is Scalable for LLM Training")."""


def adjusted_lr(lr: float, rule: AdjustLR | str, rows: int, cols: int, rms: float) -> float:
    """The step size for an [rows, cols] matrix, computed in the same order as torch.optim.Muon.

    Args:
        lr: The group's learning rate.
        rule: An :class:`AdjustLR` value.
        rows: M, the output dim (fan-out).
        cols: N, the input dim (fan-in).
        rms: Target update RMS for ``"match_rms_adamw"`` (torch hard-codes 0.2).
    """
    if AdjustLR(rule) is AdjustLR.ORIGINAL:
        ratio = math.sqrt(max(1, rows / cols))
    else:
        ratio = rms * math.sqrt(max(rows, cols))
    return lr * ratio


def matrix_dims(shape: torch.Size) -> tuple[int, int]:
    """(M, N) of the matrices Muon orthogonalises for a parameter of this shape.

    [M, N] and [E, M, N] (E experts) use the last two dims; conv weights [O, I, *kernel] are
    flattened to [O, I * prod(kernel)].
    """
    if len(shape) >= 4:
        return shape[0], math.prod(shape[1:])
    return shape[-2], shape[-1]


def _as_matrices(update: Tensor) -> Tensor:
    return update.reshape(update.shape[0], -1) if update.ndim >= 4 else update


@dataclasses.dataclass
class _Entry:
    """One parameter with a gradient, as seen by one step."""

    param: Tensor
    grad: Tensor
    group: dict[str, Any]
    label: ParamLabel


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalised by Newton-Schulz, for 2-D and higher parameters.

    Per parameter: ``buf.lerp_(g, 1 - momentum)``; the update is ``g.lerp(buf, momentum)`` with
    Nesterov, else ``buf``; it is orthogonalised by Newton-Schulz, then ``p *= 1 - lr * wd`` and
    ``p -= adjusted_lr * update``. With ``adjust_lr="original"`` and ``ns_coefficients="keller"``
    this equals ``torch.optim.Muon(..., adjust_lr_fn="original")`` on 2-D parameters. Beyond torch:
    [E, M, N] expert weights are E independent matrices, conv weights [O, I, kh, kw] are
    orthogonalised as [O, I * kh * kw], same-shape matrices run as one batched kernel, a
    parameter whose gradient holds NaN or inf is skipped for that step, and Newton-Schulz computes
    in the dtype the device multiplies fastest (``ns_dtype="auto"``: bf16 where bf16 GEMMs are
    native, fp32 on CPUs that would emulate them ~75x slower; ``ns_dtype="bf16"`` for bit
    equality with torch.optim.Muon everywhere).

    Attributes:
        skipped_steps: Counter, parameter label (name, or flat index when unnamed) -> number of
            steps skipped because that parameter's gradient was not finite.
        ns_coefficients: The resolved (a, b, c) of every Newton-Schulz step.
        ns_dtype: The Newton-Schulz compute dtype setting (resolved per device at the first step).
        eps: Lower bound of each matrix's norm inside Newton-Schulz.
        memory_budget_bytes: Cap on one Newton-Schulz batch's estimated memory (None: no cap).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 2e-2,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: CoefficientSpec = "keller",
        adjust_lr: AdjustLR | str = "match_rms_adamw",
        matched_adamw_rms: float = 0.2,
        eps: float = 1e-7,
        memory_budget_bytes: int | None = None,
        ns_dtype: NsDtype | str | torch.dtype = NsDtype.AUTO,
    ) -> None:
        """Build the optimizer; every error is raised here rather than at the first step.

        Args:
            params: Tensors, (name, tensor) pairs, or param-group dicts; every parameter must be
                floating point with at least two dims.
            lr: Learning rate, >= 0.
            weight_decay: Decoupled weight decay, >= 0.
            momentum: Momentum factor in [0, 1).
            nesterov: Use the Nesterov update ``g.lerp(buf, momentum)``.
            ns_steps: Newton-Schulz steps, >= 1.
            ns_coefficients: ``"keller"``, ``"quintic"``, ``"polar_express"`` or (a, b, c).
            adjust_lr: ``"original"`` or ``"match_rms_adamw"`` (see :class:`AdjustLR`).
            matched_adamw_rms: Target update RMS for ``"match_rms_adamw"``, > 0.
            eps: Lower bound of each matrix's norm in Newton-Schulz, > 0.
            memory_budget_bytes: Cap on one Newton-Schulz batch's estimated memory; None for no
                cap.
            ns_dtype: Newton-Schulz compute dtype: ``"auto"`` (bf16 where the device has fast
                bf16 GEMMs, decided from its capability and one timing cached per device; fp32
                elsewhere), ``"bf16"`` (equal to torch.optim.Muon), ``"fp32"`` or ``"fp16"``.

        Raises:
            ValueError: A hyperparameter is out of range, a group overrides a Newton-Schulz
                setting, or a parameter has fewer than two dims or is not floating point.
        """
        self.ns_coefficients = newton_schulz.resolve_coefficients(ns_coefficients, ns_steps)
        if not (isinstance(eps, int | float) and eps > 0):
            raise ValueError(f"Muon: eps={eps!r} is invalid; it must be a number > 0")
        newton_schulz.check_memory_budget(memory_budget_bytes, owner="Muon: ")
        self.ns_dtype = newton_schulz.check_ns_dtype(ns_dtype)
        self.eps = float(eps)
        self.memory_budget_bytes = memory_budget_bytes
        self.skipped_steps: collections.Counter[ParamLabel] = collections.Counter()
        self._engine: Engine | None = None
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "adjust_lr": adjust_lr,
            "matched_adamw_rms": matched_adamw_rms,
        }
        _check_group_hyperparameters(defaults, "Muon")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyperparameters and parameters (see ``__init__``)."""
        index = len(self.param_groups)
        overridden = [key for key in _OPTIMIZER_WIDE if key in param_group]
        if overridden:
            raise ValueError(
                f"Muon param group {index} sets {overridden}; Newton-Schulz settings apply to the "
                "whole optimizer, pass them to Muon(...) instead"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group_hyperparameters(group, f"Muon param group {index}")
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            label = repr(names[i]) if names else f"{i} of param group {index}"
            _check_param(p, label)
        if len({_is_dtensor(p) for g in self.param_groups for p in g["params"]}) > 1:
            self.param_groups.pop()
            raise ValueError(_MIXED_PARAMS)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over every parameter that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss; run with grad enabled.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._collect_entries()
        if not entries:
            return loss
        self._check_engine([e.param for e in entries])
        finite = self._finite_flags([e.grad for e in entries])
        kept: list[_Entry] = []
        updates: list[Tensor] = []
        for entry, ok in zip(entries, finite, strict=True):
            if not ok:
                self._skip(entry)
                continue
            kept.append(entry)
            updates.append(self._momentum_update(entry))
        if not kept:
            return loss
        ortho = self._orthogonalize_updates(updates, [e.param for e in kept])
        for entry, update in zip(kept, ortho, strict=True):
            self._apply_update(entry, update)
        return loss

    def _orthogonalize_updates(self, updates: list[Tensor], params: list[Tensor]) -> list[Tensor]:
        """Orthogonalise every momentum update in one call so same-shape matrices batch together.

        The seam for the distributed engine: when :attr:`_engine` is set it gets the whole list.

        Args:
            updates: One per parameter, shaped like it, floating point.
            params: The parameters, same order.

        Returns:
            The orthogonalised updates, shaped like their parameters.
        """
        if self._engine is not None:
            return self._engine(updates, params)
        self._check_engine(params)
        results = self.orthogonalize_matrices([_as_matrices(u) for u in updates])
        return [r.reshape(u.shape) for r, u in zip(results, updates, strict=True)]

    def orthogonalize_matrices(self, matrices: list[Tensor]) -> list[Tensor]:
        """Newton-Schulz with this optimizer's settings on whole, local matrices.

        The kernel a distributed engine runs once it has gathered whole matrices.

        Args:
            matrices: Each [M, N] or [E, M, N] (E experts), floating point.

        Returns:
            The orthogonalised matrices, same shapes and dtypes, same order.
        """
        return newton_schulz.orthogonalize(
            matrices,
            self.ns_coefficients,
            eps=self.eps,
            memory_budget_bytes=self.memory_budget_bytes,
            ns_dtype=self.ns_dtype,
        )

    def _check_engine(self, params: Sequence[Tensor]) -> None:
        # Decided before any state changes. DTensor parameters (FSDP2 / HSDP) get the sharded
        # engine: Newton-Schulz on local shards would give wrong updates.
        if self._engine is None and any(_is_dtensor(p) for p in params):
            if not all(_is_dtensor(p) for p in params):
                raise ValueError(_MIXED_PARAMS)
            from hyperparallel.optim.distributed import ShardedNewtonSchulz

            # Several communication batches let batch k + 1's gather overlap batch k's NS.
            self._engine = ShardedNewtonSchulz(
                self.orthogonalize_matrices,
                batch_bytes=self.memory_budget_bytes or DEFAULT_COMM_BATCH_BYTES,
            )

    def _collect_entries(self) -> list[_Entry]:
        entries = []
        flat_index = 0
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    label = names[i] if names else flat_index
                    if p.grad.is_sparse:
                        raise ValueError(
                            f"Muon got a sparse gradient for parameter {label!r}; Newton-Schulz "
                            "needs dense matrices, route it to torch.optim.SparseAdam"
                        )
                    entries.append(_Entry(p, p.grad, group, label))
                flat_index += 1
        return entries

    @staticmethod
    def _finite_flags(grads: Sequence[Tensor]) -> list[bool]:
        # One host sync per device instead of one per parameter.
        by_device: dict[torch.device, list[int]] = {}
        for i, g in enumerate(grads):
            by_device.setdefault(g.device, []).append(i)
        flags = [True] * len(grads)
        for indices in by_device.values():
            checks = torch.stack([torch.isfinite(_local_shard(grads[i])).all() for i in indices])
            _agree_across_mesh(checks, [grads[i] for i in indices])
            values = checks.tolist()
            for i, value in zip(indices, values, strict=True):
                flags[i] = value
        return flags

    def _skip(self, entry: _Entry) -> None:
        self.skipped_steps[entry.label] += 1
        warnings.warn(
            f"Muon skipped parameter {entry.label!r} this step: its gradient holds NaN or inf. "
            "Its weights and momentum are unchanged; see Muon.skipped_steps for the count",
            RuntimeWarning,
            stacklevel=3,
        )

    def _momentum_update(self, entry: _Entry) -> Tensor:
        state = self.state[entry.param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(
                entry.grad, memory_format=torch.preserve_format
            )
        buf = state["momentum_buffer"]
        momentum = entry.group["momentum"]
        buf.lerp_(entry.grad, 1 - momentum)
        return entry.grad.lerp(buf, momentum) if entry.group["nesterov"] else buf

    @staticmethod
    def _apply_update(entry: _Entry, update: Tensor) -> None:
        group = entry.group
        lr = float(group["lr"])
        rows, cols = matrix_dims(entry.param.shape)
        step = adjusted_lr(lr, group["adjust_lr"], rows, cols, group["matched_adamw_rms"])
        entry.param.mul_(1 - lr * group["weight_decay"])
        entry.param.add_(update, alpha=-step)


_MIXED_PARAMS = (
    "Muon got both DTensor and plain tensor parameters; use one optimizer for the sharded "
    "parameters and another for the rest"
)


def _check_group_hyperparameters(group: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the first out-of-range hyperparameter of a group."""
    checks = (
        ("lr", lambda v: v >= 0, "a finite number >= 0"),
        ("weight_decay", lambda v: v >= 0, "a finite number >= 0"),
        ("momentum", lambda v: 0 <= v < 1, "a number in [0, 1)"),
        ("matched_adamw_rms", lambda v: v > 0, "a number > 0"),
    )
    for key, ok, allowed in checks:
        value = group[key]
        number = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
        if (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not math.isfinite(number)  # lr=inf would turn every weight into inf or NaN
            or not ok(number)
        ):
            raise ValueError(f"{where}: {key}={value!r} is invalid; it must be {allowed}")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"{where}: nesterov={group['nesterov']!r} is invalid; use True or False")
    if group["adjust_lr"] not in list(AdjustLR):
        allowed = ", ".join(repr(r.value) for r in AdjustLR)
        raise ValueError(
            f"{where}: adjust_lr={group['adjust_lr']!r} is invalid; use one of {allowed}"
        )


def _local_shard(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor; ``t`` itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _agree_across_mesh(flags: Tensor, grads: Sequence[Tensor]) -> None:
    """AND the per-shard finiteness ``flags`` over the DTensors' mesh, in place.

    Every rank must skip the same parameters (one rank skipping a matrix alone would
    desynchronise the distributed Newton-Schulz). One MIN all-reduce per mesh dimension for all
    parameters: a reduction per parameter cost most of a step (measured ~95 of 125 ms for 16
    matrices on 4 CPU ranks).
    """
    from torch.distributed.tensor import DTensor

    mesh = next((g.device_mesh for g in grads if isinstance(g, DTensor)), None)
    if mesh is None:
        return
    import torch.distributed as dist

    as_int = flags.to(torch.int32)
    for dim in range(mesh.ndim):
        dist.all_reduce(as_int, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    flags.copy_(as_int.bool())


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_param(p: Tensor, label: str) -> None:
    if not p.is_floating_point():
        raise ValueError(
            f"Muon got parameter {label} with dtype {p.dtype}; only floating-point parameters "
            "can be optimised"
        )
    if p.ndim < 2:
        raise ValueError(
            f"Muon got parameter {label} with shape {tuple(p.shape)}; Muon orthogonalises "
            "matrices (2-D or more). Route 0-D and 1-D parameters (biases, norms) to "
            "torch.optim.AdamW, e.g. with hyperparallel.optim.get_hyper_optimizer"
        )
