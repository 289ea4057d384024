"""Newton-Schulz for DTensor updates on any mesh: each matrix orthogonalised once in the job.

Plugged into :class:`hyperparallel.optim.Muon` when its parameters are DTensors. Each update's
placements are read per mesh dimension:

- ``Shard(0)`` of a 2-D (or conv) update shards its rows: the cached :mod:`plan` gives each
  matrix one owner, which gathers it (packed ``all_to_all_single``), runs NS and scatters the
  rows back. At most one such dimension (the FSDP dimension).
- ``Shard(0)`` of an ``[E, M, N]`` update (experts over ``ep`` and/or ``dp_shard``) shards whole
  matrices: the local experts are orthogonalised where they are, with no communication.
- ``Replicate()`` (HSDP's ``dp_replicate``, or ``ep`` for dense weights) means every rank along
  that dimension holds the same data: the matrices are spread over it (dense ones by the plan,
  local experts by :func:`~hyperparallel.optim.plan.spread_over_replicas`) and one sum over the
  replicate group shares the results. At most one such dimension.

Communication overlaps NS: batch k + 1's gather, and batch k - 1's scatter and replica sum, run
while batch k is orthogonalised; the experts' replica sum runs during the dense batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyperparallel.optim.comm import BatchExchange, ReplicaShare, ShardLayout
from hyperparallel.optim.plan import MatrixSpec, MuonPlan, build_plan, spread_over_replicas

LocalOrthogonalize = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class _ExpertLayout:
    """An ``[E, M, N]`` update whose local experts are whole matrices; ``replicate_group`` is
    the mesh dimension (if any) along which every rank holds the same experts."""

    replicate_group: dist.ProcessGroup | None
    replica: int
    replicas: int
    device: torch.device


def _classify(update: DTensor, name: str) -> ShardLayout | _ExpertLayout:
    """Read ``update``'s placements per mesh dimension (see the module docstring).

    Raises:
        ValueError: naming the parameter, its mesh dims and placements, and what is supported.
    """
    mesh, placements = update.device_mesh, tuple(update.placements)
    dims = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    shard = [d for d, p in enumerate(placements) if p == Shard(0)]
    replicate = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    other = [d for d in range(mesh.ndim) if d not in shard and d not in replicate]
    device = update.to_local().device
    experts = update.ndim == 3
    problem = None
    if other:
        problem = f"mesh dim {dims[other[0]]!r} has {placements[other[0]]}"
    elif len(replicate) > 1:
        problem = f"it is replicated over {len(replicate)} mesh dims"
    elif not experts and len(shard) != 1:
        problem = f"its rows are sharded over {len(shard)} mesh dims"
    if problem is not None:
        raise ValueError(
            f"parameter {name}: placements {placements} on mesh dims {dims} are not supported "
            f"({problem}). Muon takes Shard(0) on the rows of a matrix over one mesh dim (FSDP), "
            "Shard(0) on E of [E, M, N] experts over any dims (EP, FSDP), and Replicate() over "
            "at most one dim (HSDP replicas, or ep for dense weights)"
        )
    rep = replicate[0] if replicate else None
    group = mesh.get_group(rep) if rep is not None else None
    replica = mesh.get_local_rank(rep) if rep is not None else 0
    if experts:
        return _ExpertLayout(group, replica, mesh.size(rep) if rep is not None else 1, device)
    (s,) = shard
    return ShardLayout(
        mesh.get_group(s), mesh.get_local_rank(s), mesh.size(s), group, replica, device
    )


class ShardedNewtonSchulz:
    """Orthogonalises a step's DTensor updates; plans are built once per parameter layout.

    Args:
        local_orthogonalize: NS on a list of whole matrices (2-D, or 3-D batches), returning
            them in order; the single-process kernel with its batching and memory cap.
        batch_bytes: most bytes of whole matrices an owner receives per communication batch.
        overlap: start each scatter and replica sum and finish it after the next batch's NS
            (True), or wait for it at once (False, the behaviour before 0.3.0, kept for the
            benchmark's comparison). The next batch's gather overlaps either way.

    Attributes:
        ns_matrices: whole matrices this rank has orthogonalised so far (an expert tensor
            counts its experts); summed over ranks it counts each matrix once per step.
    """

    def __init__(
        self,
        local_orthogonalize: LocalOrthogonalize,
        batch_bytes: int | None = None,
        overlap: bool = True,
    ):
        self.local_orthogonalize = local_orthogonalize
        self.batch_bytes = batch_bytes
        self.overlap = overlap
        self.ns_matrices = 0
        self._plans: dict[tuple, MuonPlan] = {}
        self._spreads: dict[tuple, tuple[int, ...]] = {}

    def __call__(
        self, updates: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Return the orthogonalised updates, each sharded exactly like its input.

        Every rank must pass the same parameters in the same order (as one optimizer does), so
        that collectives are issued in the same order everywhere. Typed as Muon's engine seam
        (plain ``Tensor``), which gives it DTensors only.

        Args:
            updates: momentum updates, DTensors shaped and placed like ``params``.
            params: the parameters (their order names them in error messages).

        Raises:
            TypeError: naming the first update that is not a DTensor.
        """
        names = [f"#{i} {tuple(p.shape)}" for i, p in enumerate(params)]
        sharded = [u for u in updates if isinstance(u, DTensor)]
        if len(sharded) != len(updates):
            bad = next(i for i, u in enumerate(updates) if not isinstance(u, DTensor))
            raise TypeError(
                f"ShardedNewtonSchulz orthogonalises DTensor updates; update #{bad} is a "
                f"{type(updates[bad]).__name__}"
            )
        layouts = [_classify(u, n) for u, n in zip(sharded, names, strict=True)]
        # Each group: the layout of its first member, and the indices of its members.
        rows_groups: dict[tuple, tuple[ShardLayout, list[int]]] = {}
        expert_groups: dict[tuple, tuple[_ExpertLayout, list[int]]] = {}
        for i, layout in enumerate(layouts):
            if isinstance(layout, ShardLayout):
                rows_groups.setdefault(_group_key(layout), (layout, []))[1].append(i)
            else:
                expert_groups.setdefault(_group_key(layout), (layout, []))[1].append(i)

        results: dict[int, torch.Tensor] = {}
        pipelines = [
            _RowsPipeline(self, sharded, indices, layout)
            for layout, indices in rows_groups.values()
        ]
        for pipeline in pipelines:
            pipeline.start()  # first gathers in flight while the experts compute
        shares = [
            self._experts(sharded, indices, layout, pipelines, results)
            for layout, indices in expert_groups.values()
        ]
        for pipeline in pipelines:
            results.update(pipeline.run())
        for share in shares:
            if share is not None:
                results.update(share.wait())
        return [
            DTensor.from_local(
                results[i].reshape(u.to_local().shape).to(u.dtype),
                u.device_mesh,
                u.placements,
                run_check=False,
                shape=u.shape,
                stride=u.stride(),
            )
            for i, u in enumerate(sharded)
        ]

    def orthogonalize(self, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local kernel, counting the matrices it is given."""
        self.ns_matrices += sum(m.shape[0] if m.ndim == 3 else 1 for m in matrices)
        return self.local_orthogonalize(matrices)

    def _experts(
        self,
        updates: list[DTensor],
        indices: list[int],
        layout: _ExpertLayout,
        pipelines: list[_RowsPipeline],
        results: dict[int, torch.Tensor],
    ) -> ReplicaShare | None:
        """Orthogonalise this rank's share of its local experts; start the replica sum."""
        local = {i: updates[i].to_local().float() for i in indices}
        items = [(i, e) for i in indices for e in range(local[i].shape[0])]
        if layout.replicate_group is None:
            mine = items
        else:
            spread = self._spread(local, items, layout, pipelines)
            mine = [item for item, r in zip(items, spread, strict=True) if r == layout.replica]
        chosen = {i: [e for j, e in mine if j == i] for i in indices}
        todo = [i for i in indices if chosen[i]]
        whole = {i: len(chosen[i]) == local[i].shape[0] for i in todo}
        inputs = [local[i] if whole[i] else local[i][chosen[i]] for i in todo]
        outs = self.orthogonalize(inputs) if todo else []
        computed = {}
        for i, out in zip(todo, outs, strict=True):
            if whole[i]:
                computed[i] = out
            else:  # zeros elsewhere: the replica sum fills them in exactly
                computed[i] = torch.zeros_like(local[i])
                computed[i][chosen[i]] = out.to(local[i].dtype)
        for i in indices:
            if local[i].numel() == 0:  # fewer experts than ranks
                results[i] = local[i]
        if layout.replicate_group is None:
            results.update(computed)
            return None
        shared = [i for i in indices if local[i].numel()]
        if not shared:
            return None
        share = ReplicaShare(
            computed,
            {i: tuple(local[i].shape) for i in shared},
            torch.float32,
            layout.replicate_group,
            layout.device,
        )
        if not self.overlap:
            results.update(share.wait())
            return None
        return share

    def _spread(
        self,
        local: dict[int, torch.Tensor],
        items: list[tuple[int, int]],
        layout: _ExpertLayout,
        pipelines: list[_RowsPipeline],
    ) -> tuple[int, ...]:
        # Start from the dense work each replica of this rank already has when the dense
        # matrices are spread over the same replicate group (HSDP), so the sum is balanced.
        start = replica_start_load(
            [
                (pipeline.plan, pipeline.layout.shard_rank)
                for pipeline in pipelines
                if pipeline.layout.replicate_group is layout.replicate_group
            ],
            layout.replicas,
        )
        shapes = [(local[i].shape[1], local[i].shape[2]) for i, _ in items]
        key = (tuple(shapes), tuple(start))
        if key not in self._spreads:
            self._spreads[key] = spread_experts(shapes, layout.replicas, start)
        return self._spreads[key]

    def _plan(self, shapes: dict[int, tuple[int, int]], layout: ShardLayout) -> MuonPlan:
        replicas = 1 if layout.replicate_group is None else layout.replicate_group.size()
        key = (tuple(sorted(shapes.items())), layout.shard_size, replicas, self.batch_bytes)
        if key not in self._plans:
            self._plans[key] = plan_rows(shapes, layout.shard_size, replicas, self.batch_bytes)
        return self._plans[key]


def row_matrix(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view NS orthogonalises of a row-sharded update: ``(rows, trailing dims)``."""
    return shape[0], math.prod(shape[1:])


def plan_rows(
    shapes: dict[int, tuple[int, int]], shard_size: int, replicas: int, batch_bytes: int | None
) -> MuonPlan:
    """The owner plan of one layout's row-sharded matrices (``index -> (rows, cols)``), as
    every rank of the layout builds it (pure: the planner calls it for any world size)."""
    specs = [MatrixSpec(i, rows, cols) for i, (rows, cols) in shapes.items()]
    return build_plan(specs, shard_size, replicas, batch_bytes)


def replica_start_load(plans: Sequence[tuple[MuonPlan, int]], replicas: int) -> list[int]:
    """NS cost each replica of a rank already carries from the dense plans spread over the same
    replicate group: ``plans`` holds each such plan with the rank's shard rank in it."""
    start = [0] * replicas
    for plan, shard_rank in plans:
        for replica in range(replicas):
            start[replica] += plan.load.get((replica, shard_rank), 0)
    return start


def spread_experts(
    shapes: Sequence[tuple[int, int]], replicas: int, start: Sequence[int]
) -> tuple[int, ...]:
    """Which replica orthogonalises each of a rank's local expert matrices (``(M, N)`` each, in
    the engine's order: parameters, then experts), balanced on top of ``start``."""
    costs = [MatrixSpec(0, rows, cols).ns_cost for rows, cols in shapes]
    return spread_over_replicas(costs, replicas, start)


class _RowsPipeline:
    """The row-sharded matrices of one layout: batches gathered, orthogonalised and scattered
    with communication overlapping NS."""

    def __init__(
        self,
        engine: ShardedNewtonSchulz,
        updates: list[DTensor],
        indices: list[int],
        layout: ShardLayout,
    ) -> None:
        self.engine, self.layout = engine, layout
        shapes = {i: row_matrix(updates[i].shape) for i in indices}
        self.plan = engine._plan(shapes, layout)
        local_rows = {i: updates[i].to_local().reshape(-1, shapes[i][1]).float() for i in indices}
        self.exchanges = [
            BatchExchange(batch, local_rows, shapes, layout) for batch in self.plan.batches
        ]

    def start(self) -> None:
        """Start the first batch's gather."""
        if self.exchanges:
            self.exchanges[0].start_gather()

    def run(self) -> dict[int, torch.Tensor]:
        """Run every batch; return this rank's rows of every matrix, by index."""
        results: dict[int, torch.Tensor] = {}
        exchanges, previous = self.exchanges, None
        for k, exchange in enumerate(exchanges):
            owned = exchange.finish_gather()
            if k + 1 < len(exchanges):
                exchanges[k + 1].start_gather()  # overlaps this batch's NS
            if previous is not None and previous.shares_across_replicas:
                previous.finish_scatter()  # its replica sum now overlaps this batch's NS
            out = self.engine.orthogonalize(owned) if owned else []
            if previous is not None:
                results.update(previous.finish())
            if self.engine.overlap:
                exchange.start_scatter(out)
                previous = exchange
            else:
                results.update(exchange.scatter(out))
        if previous is not None:
            results.update(previous.finish())
        return results


def _group_key(layout: ShardLayout | _ExpertLayout) -> tuple:
    if isinstance(layout, ShardLayout):
        return ("rows", id(layout.shard_group), id(layout.replicate_group))
    return ("experts", id(layout.replicate_group))
