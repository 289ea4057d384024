"""What one rank of a real run measures, for checking the planner: one steady-state training step
of the job's model counted collective by collective, the bytes of its parameter, gradient and
optimizer-state tensors, its saved activations, and the matrices its Newton-Schulz ran on.

The rank is built by the job's own calls (model spec, mesh, optimizer) and steps as the trainer
does; step 1 warms up (Muon's plans and state are made there), step 2 is measured. Group names
follow :func:`dim_of_group`, the names :mod:`hyperparallel.plan.collectives` predicts under.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyperparallel.activation import ActivationTracker, SwapSchedule
from hyperparallel.optim.hybrid import HybridOptimizer
from hyperparallel.parallel.mesh import FLATTENED_DIMS, ParallelDims, parse_mesh
from hyperparallel.plan.inventory import mesh_coords
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.optimizer import build_optimizer
from hyperparallel.train.parallel_model import ParallelModel
from hyperparallel.train.registry import model_spec
from npu_core.dist.counting import CollectiveLog, CollectiveTotal, count_collectives

GROUP_NAMES = ("pp", "dp_replicate", "ep", "dp_shard", "dp_shard_ep", "dp")
"""Names a process group may carry, in order of preference where several name the same ranks
(``dp_shard_ep`` is ``dp_shard`` when ``ep`` is 1): a mesh dimension before a flattened one."""

SELF = "self"
"""Name of a one-rank group (every dimension of it has size 1)."""


def _components(name: str) -> tuple[str, ...]:
    return FLATTENED_DIMS.get(name, (name,))


def dim_name(dims: ParallelDims, name: str) -> str:
    """The name collectives on mesh dimension ``name`` are reported under: the preferred name
    of the same group of ranks under ``dims`` (dimensions of size 1 do not change a group)."""
    wide = {d for d in _components(name) if getattr(dims, d) > 1}
    if not wide:
        return SELF
    for candidate in GROUP_NAMES:
        if {d for d in _components(candidate) if getattr(dims, d) > 1} == wide:
            return candidate
    raise ValueError(f"no mesh dimension name covers {sorted(wide)}")


def group_ranks(dims: ParallelDims, name: str, rank: int) -> tuple[int, ...]:
    """Global ranks of ``rank``'s group along mesh dimension ``name`` (pure: from the row-major
    layout of the world mesh), in group-rank order."""
    mine = mesh_coords(dims, rank)
    along = set(_components(name))
    return tuple(
        r
        for r in range(dims.world_size)
        if all(c == mine[d] for d, c in mesh_coords(dims, r).items() if d not in along)
    )


def dim_of_group(dims: ParallelDims, ranks: tuple[int, ...], rank: int) -> str:
    """The name of the group ``ranks`` that ``rank`` belongs to, or ``"other"`` when it is no
    mesh dimension's group (e.g. the world under pp)."""
    if len(ranks) == 1:
        return SELF
    for name in GROUP_NAMES:
        if group_ranks(dims, name, rank) == ranks:
            return dim_name(dims, name)
    if ranks == tuple(range(dims.world_size)):
        return "world"
    return "other"


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's measured step.

    Attributes:
        rank: global rank.
        collectives: ``(kind, dimension name) -> calls and bytes`` of the measured step.
        param_bytes: bytes of this rank's parameter tensors (local shards).
        grad_bytes: bytes of this rank's gradients after backward (local shards).
        optimizer_bytes: bytes of this rank's optimizer-state tensors after the step.
        activation: saved-activation bytes of the step by placement (ActivationTracker).
        ns_matrices: ``(rows, cols) -> count`` of the matrices this rank's Newton-Schulz
            orthogonalised in the measured step (an expert stack counts each expert).
        step_s: wall time of the uncounted step 3, for reports beside the estimate.
    """

    rank: int
    collectives: dict[tuple[str, str], CollectiveTotal]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation: dict[str, int]
    ns_matrices: dict[tuple[int, int], int]
    step_s: float


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _state_bytes(optimizers: tuple[torch.optim.Optimizer, ...]) -> int:
    return sum(
        _local_bytes(value)
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def _counting_ns(
    kernel: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    seen: dict[tuple[int, int], int],
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """``kernel`` that also adds each matrix it is given to ``seen`` (``[E, M, N]``: E of them)."""

    def orthogonalize(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        for m in matrices:
            key = (int(m.shape[-2]), int(m.shape[-1]))
            seen[key] = seen.get(key, 0) + (int(m.shape[0]) if m.ndim == 3 else 1)
        return kernel(matrices)

    return orthogonalize


def measure_rank(cfg: TrainConfig) -> RankMeasurement:
    """Build the job's model on this rank's mesh (an initialised default group of
    ``parallel.mesh``'s size, CPU tensors), train three steps and report the second.

    The optimizer is the trainer's (:func:`~hyperparallel.train.optimizer.build_optimizer`).
    """
    device = torch.device("cpu")
    spec = model_spec(cfg)
    data = spec.batches()
    dims = parse_mesh(cfg.parallel.mesh, dist.get_world_size())
    batch = spec.check_layout(dims)
    meshes = dims.build(device.type)
    net = spec.build(meshes, device)
    optimizer = build_optimizer(cfg, net)
    inner = tuple(o for o in (optimizer.muon, optimizer.adamw) if o is not None)
    ns_seen: dict[tuple[int, int], int] = {}
    if optimizer.muon is not None:
        muon = optimizer.muon
        muon.orthogonalize_matrices = _counting_ns(  # type: ignore[method-assign,assignment]
            muon.orthogonalize_matrices, ns_seen
        )
    rank = dist.get_rank()
    steps = [_Step() for _ in range(3)]
    for index, step in enumerate(steps):
        inputs, targets = data.train_batch(index, meshes.dp_rank, batch)
        ns_seen.clear()
        step.run(net, optimizer, inputs, targets, cfg, counted=index == 1)
        step.ns = dict(ns_seen)
    measured = steps[1]
    totals: dict[tuple[str, str], CollectiveTotal] = {}
    for (kind, ranks), total in measured.log.totals().items():
        key = (kind, dim_of_group(dims, ranks, rank))
        before = totals.get(key, CollectiveTotal(0, 0))
        totals[key] = CollectiveTotal(before.calls + total.calls, before.bytes + total.bytes)
    return RankMeasurement(
        rank=rank,
        collectives=totals,
        param_bytes=sum(_local_bytes(p) for p in _unique_parameters(net.owner)),
        grad_bytes=measured.grad_bytes,
        optimizer_bytes=_state_bytes(inner),
        activation=measured.activation,
        ns_matrices=measured.ns,
        step_s=steps[2].seconds,
    )


@dataclass
class _Step:
    """One training step as the trainer runs it, and what it measured."""

    log: CollectiveLog = field(default_factory=CollectiveLog)
    grad_bytes: int = 0
    activation: dict[str, int] = field(default_factory=dict)
    ns: dict[tuple[int, int], int] = field(default_factory=dict)
    seconds: float = 0.0

    def run(
        self,
        net: ParallelModel,
        optimizer: HybridOptimizer,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        cfg: TrainConfig,
        *,
        counted: bool,
    ) -> None:
        """Forward, backward and optimizer step; collectives are logged when ``counted``."""
        act = cfg.activation
        schedule = SwapSchedule(act.offload_after, act.prefetch_ahead, act.early_recompute)
        began = time.perf_counter()
        with count_collectives() if counted else nullcontext(self.log) as log:
            with ActivationTracker() as tracker, schedule:
                net.forward_backward(inputs, targets)
            self.grad_bytes = sum(
                _local_bytes(p.grad) for p in _unique_parameters(net.owner) if p.grad is not None
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.seconds = time.perf_counter() - began
        self.log = log
        self.activation = tracker.report().to_dict()


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())
