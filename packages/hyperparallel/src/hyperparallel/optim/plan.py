"""Who orthogonalises which matrix: a communication-free plan for distributed Muon.

Newton-Schulz needs whole matrices while FSDP2 shards their rows across ranks. Running NS on every
rank repeats the same work W times; instead each matrix gets exactly one owner, chosen greedily
(largest first, to the least-loaded owner), and with HSDP the replica groups split the matrices
between them too, so each NS runs once in the whole job. Pure Python: no torch.distributed here,
so the plan is unit-testable and identical on every rank (all ranks compute it from the same
inputs and the same deterministic order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MatrixSpec:
    """One update to orthogonalise, as every rank sees it.

    Attributes:
        index: position in the optimizer's list of updates.
        rows: global size of the sharded (first) dimension of the 2-D view.
        cols: global size of the second dimension of the 2-D view (trailing dims flattened).
        itemsize: bytes per element of the update.
    """

    index: int
    rows: int
    cols: int
    itemsize: int = 4

    @property
    def ns_cost(self) -> int:
        """Relative NS cost: each iteration is a few matmuls of M x N with min(M, N)."""
        return self.rows * self.cols * min(self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


@dataclass(frozen=True)
class Assignment:
    """Matrix ``index`` is orthogonalised by shard rank ``owner`` of replica group ``replica``."""

    index: int
    replica: int
    owner: int


@dataclass(frozen=True)
class MuonPlan:
    """Owners for every matrix, cut into communication batches.

    Attributes:
        batches: each batch is gathered with one packed collective, orthogonalised, and sent
            back; batch k + 1's gather overlaps batch k's NS.
        load: NS cost given to each (replica, owner) slot, for reporting balance.
    """

    batches: tuple[tuple[Assignment, ...], ...]
    load: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def assignments(self) -> list[Assignment]:
        return [a for batch in self.batches for a in batch]

    def imbalance(self) -> float:
        """Most-loaded slot over the mean load (1.0 is perfect balance)."""
        loads = list(self.load.values())
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 1.0


def shard_rows(rows: int, shards: int) -> list[int]:
    """Rows held by each shard rank under ``Shard(0)``: torch.chunk semantics.

    Every rank gets ceil(rows / shards) rows until they run out, so trailing ranks may hold fewer
    rows or none at all (e.g. 5 rows on 4 ranks -> [2, 2, 1, 0]).
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    chunk = -(-rows // shards) if rows else 0
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(shards)]


def build_plan(
    specs: list[MatrixSpec],
    shard_size: int,
    replicate_size: int = 1,
    batch_bytes: int | None = None,
) -> MuonPlan:
    """Assign an owner to every matrix and cut the assignments into batches.

    Args:
        specs: the matrices, in optimizer order.
        shard_size: ranks in a shard group (FSDP degree).
        replicate_size: replica groups (HSDP replicate degree; 1 for plain FSDP2).
        batch_bytes: most bytes of full matrices one owner receives per batch; None puts
            everything in one batch. A matrix larger than the budget gets a batch of its own.

    Returns:
        The plan; identical on every rank for identical inputs.
    """
    if shard_size < 1 or replicate_size < 1:
        raise ValueError(
            f"shard_size and replicate_size must be >= 1, got {shard_size}, {replicate_size}"
        )
    if batch_bytes is not None and batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be positive or None, got {batch_bytes}")
    slots = [(replica, owner) for replica in range(replicate_size) for owner in range(shard_size)]
    load = dict.fromkeys(slots, 0)
    # Largest first, ties broken by index so every rank derives the same plan.
    order = sorted(specs, key=lambda s: (-s.ns_cost, s.index))
    owned: dict[tuple[int, int], list[MatrixSpec]] = {slot: [] for slot in slots}
    for spec in order:
        slot = min(slots, key=lambda s: (load[s], s))
        load[slot] += spec.ns_cost
        owned[slot].append(spec)
    return MuonPlan(batches=_cut_batches(owned, batch_bytes), load=load)


def _cut_batches(
    owned: dict[tuple[int, int], list[MatrixSpec]], batch_bytes: int | None
) -> tuple[tuple[Assignment, ...], ...]:
    """Batch k holds each owner's k-th chunk of matrices, chunks capped at ``batch_bytes``."""
    chunks_per_slot: dict[tuple[int, int], list[list[MatrixSpec]]] = {}
    for slot, specs in owned.items():
        chunks: list[list[MatrixSpec]] = []
        size = 0
        for spec in specs:
            if not chunks or (batch_bytes is not None and size + spec.nbytes > batch_bytes):
                chunks.append([])
                size = 0
            chunks[-1].append(spec)
            size += spec.nbytes
        chunks_per_slot[slot] = chunks
    depth = max((len(c) for c in chunks_per_slot.values()), default=0)
    batches = []
    for k in range(depth):
        batch = [
            Assignment(spec.index, replica, owner)
            for (replica, owner), chunks in sorted(chunks_per_slot.items())
            if k < len(chunks)
            for spec in chunks[k]
        ]
        batches.append(tuple(sorted(batch, key=lambda a: a.index)))
    return tuple(batches)


def spread_over_replicas(
    costs: Sequence[int], replicate_size: int, start_load: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Which replica orthogonalises each of a rank's local whole matrices (expert shards).

    Local matrices (MoE experts sharded on E) are identical on every replica of a rank, so each
    is given to one replica, greedily, largest first to the least-loaded one; the replicas then
    share results. Every replica computes the same answer from the same inputs.

    Args:
        costs: NS cost of each local matrix (e.g. :attr:`MatrixSpec.ns_cost`), in a fixed order.
        replicate_size: replicas sharing these matrices.
        start_load: NS cost each replica already carries (its share of the gathered matrices),
            so the total per rank is balanced; None for zeros.

    Returns:
        The replica index of each matrix, in ``costs`` order.
    """
    if replicate_size < 1:
        raise ValueError(f"replicate_size must be >= 1, got {replicate_size}")
    load = list(start_load) if start_load is not None else [0] * replicate_size
    if len(load) != replicate_size:
        raise ValueError(
            f"start_load has {len(load)} entries; it needs one per replica ({replicate_size})"
        )
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        replica = min(range(replicate_size), key=lambda r: (load[r], r))
        owner[i] = replica
        load[replica] += costs[i]
    return tuple(owner)
