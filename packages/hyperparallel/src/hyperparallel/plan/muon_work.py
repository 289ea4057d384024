"""Newton-Schulz work per rank: the real owner assignment of distributed Muon, at any world size.

For each pipeline rank the Muon parameters it holds are laid out as the engine sees them
(:class:`~hyperparallel.optim.distributed.ShardedNewtonSchulz`): row-sharded matrices over the
dense mesh get one owner each from :func:`~hyperparallel.optim.distributed.plan_rows`, expert
stacks are orthogonalised where they are stored and, with replicas, spread over them by
:func:`~hyperparallel.optim.distributed.spread_experts` on top of the dense load. Two other
schemes on the same mesh are given for comparison: every rank orthogonalising every matrix
(``gather-all``: what ``torch.optim.Muon`` does on FSDP2 DTensors) and one matrix per rank in turn
(``all-to-all``: dense matrices dealt round-robin in optimizer order over the shard group, each
replica group repeating them, experts local; as Dion's all-to-all scheme).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperparallel.optim.distributed import (
    plan_rows,
    replica_start_load,
    row_matrix,
    spread_experts,
)
from hyperparallel.optim.muon import DEFAULT_COMM_BATCH_BYTES
from hyperparallel.optim.plan import shard_rows
from hyperparallel.plan.inventory import Inventory, ParamEntry, mesh_coords

NS_STEPS = 5
"""Newton-Schulz steps of the train job's Muon (its default ``ns_steps``)."""

SCHEMES = ("hyperparallel", "gather-all", "all-to-all")
"""The owner schemes :func:`ns_work` compares."""


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of Newton-Schulz on one ``[rows, cols]`` matrix: per step the Gram matrix
    ``X X^T`` (``2 m^2 n``), the polynomial ``b A + c A A`` (``2 m^3``) and ``a X + B X``
    (``2 m^2 n``), with ``m = min(rows, cols)`` (the kernel transposes tall matrices)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class NSWork:
    """Newton-Schulz work of one step under one scheme.

    Attributes:
        scheme: one of :data:`SCHEMES`.
        matrices: whole matrices each rank orthogonalises (an expert counts once), by rank.
        flops: their FLOPs (:func:`ns_flops`), by rank.
        unique_flops: the FLOPs of every Muon matrix of the model once (what one step needs).
    """

    scheme: str
    matrices: tuple[int, ...]
    flops: tuple[int, ...]
    unique_flops: int

    @property
    def max_flops(self) -> int:
        return max(self.flops, default=0)

    @property
    def mean_flops(self) -> float:
        return sum(self.flops) / len(self.flops) if self.flops else 0.0

    @property
    def balance(self) -> float:
        """Most-loaded rank over the mean (1.0 is perfect balance)."""
        mean = self.mean_flops
        return self.max_flops / mean if mean else 1.0

    @property
    def redundancy(self) -> float:
        """FLOPs spent over all ranks per FLOP the step needs (1.0: each matrix once)."""
        return sum(self.flops) / self.unique_flops if self.unique_flops else 1.0


@dataclass(frozen=True)
class _Layout:
    """One pipeline rank's Muon parameters as the engine groups them."""

    rows: dict[int, tuple[int, int]]  # optimizer index -> (rows, cols), row-sharded matrices
    experts: list[ParamEntry]  # [E, M, N] stacks, in optimizer order


def _layout(inv: Inventory, pp_rank: int) -> _Layout:
    muon = [p for p in inv.params_of(pp_rank) if p.optimizer == "muon"]
    rows = {i: row_matrix(p.shape) for i, p in enumerate(muon) if len(p.shape) != 3}
    return _Layout(rows, [p for p in muon if len(p.shape) == 3])


def _local_experts(inv: Inventory, entry: ParamEntry) -> list[int]:
    """Experts of ``entry`` stored on each shard rank: ``E / (ep x dp_shard)`` on the ep mesh,
    else FSDP's ``Shard(0)`` chunks of E over the dense shard group."""
    shards = inv.dims.ep * inv.dims.dp_shard
    n_experts = entry.shape[0]
    if entry.expert:
        return [n_experts // shards] * shards
    return shard_rows(n_experts, shards)


def ns_work(
    inv: Inventory, scheme: str = "hyperparallel", batch_bytes: int = DEFAULT_COMM_BATCH_BYTES
) -> NSWork:
    """Newton-Schulz matrices and FLOPs of every rank under ``scheme``.

    Args:
        inv: the model and layout (:func:`~hyperparallel.plan.inventory.model_inventory`).
        scheme: ``hyperparallel`` (the engine's own assignment), ``gather-all`` or
            ``all-to-all`` (see the module docstring).
        batch_bytes: the engine's communication batch (the job's Muon default); it cuts
            batches, not owners, so the work does not depend on it.

    Raises:
        ValueError: an unknown scheme.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    dims = inv.dims
    shard_size, replicas = dims.ep * dims.dp_shard, dims.dp_replicate
    per_pp = [
        _stage_work(inv, pp, scheme, shard_size, replicas, batch_bytes) for pp in range(dims.pp)
    ]
    matrices, flops = [], []
    for rank in range(dims.world_size):
        coords = mesh_coords(dims, rank)
        shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
        count, work = per_pp[coords["pp"]][(coords["dp_replicate"], shard_rank)]
        matrices.append(count)
        flops.append(work)
    unique = sum(_unique_flops(_layout(inv, pp)) for pp in range(dims.pp))
    return NSWork(scheme, tuple(matrices), tuple(flops), unique)


def _unique_flops(layout: _Layout) -> int:
    total = sum(ns_flops(r, c) for r, c in layout.rows.values())
    return total + sum(p.shape[0] * ns_flops(p.shape[1], p.shape[2]) for p in layout.experts)


def _stage_work(
    inv: Inventory, pp_rank: int, scheme: str, shard_size: int, replicas: int, batch_bytes: int
) -> dict[tuple[int, int], tuple[int, int]]:
    """``(replica, shard rank) -> (matrices, FLOPs)`` for the ranks of one pipeline rank."""
    layout = _layout(inv, pp_rank)
    slots = [(r, s) for r in range(replicas) for s in range(shard_size)]
    if scheme == "gather-all":
        total = len(layout.rows) + sum(p.shape[0] for p in layout.experts)
        return dict.fromkeys(slots, (total, _unique_flops(layout)))
    work = {slot: [0, 0] for slot in slots}
    if scheme == "hyperparallel":
        plan = plan_rows(layout.rows, shard_size, replicas, batch_bytes)
        for a in plan.assignments:
            work[(a.replica, a.owner)][0] += 1
            work[(a.replica, a.owner)][1] += ns_flops(*layout.rows[a.index])
    else:
        for position, index in enumerate(layout.rows):
            for replica in range(replicas):
                slot = work[(replica, position % shard_size)]
                slot[0] += 1
                slot[1] += ns_flops(*layout.rows[index])
    local = [_local_experts(inv, p) for p in layout.experts]
    for shard_rank in range(shard_size):
        shapes = [
            (p.shape[1], p.shape[2])
            for p, counts in zip(layout.experts, local, strict=True)
            for _ in range(counts[shard_rank])
        ]
        if scheme == "hyperparallel" and replicas > 1:
            start = replica_start_load([(plan, shard_rank)] if layout.rows else [], replicas)
            owner = spread_experts(shapes, replicas, start)
        else:
            owner = None
        for replica in range(replicas):
            mine = [s for k, s in enumerate(shapes) if owner is None or owner[k] == replica]
            slot = work[(replica, shard_rank)]
            slot[0] += len(mine)
            slot[1] += sum(ns_flops(*s) for s in mine)
    return {slot: (count, flops) for slot, (count, flops) in work.items()}
