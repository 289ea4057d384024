"""Newton-Schulz for FSDP2 / HSDP DTensor updates: each matrix orthogonalised once in the job.

Plugged into :class:`hyperparallel.optim.Muon` when its parameters are DTensors. Matrices whose
sharded dimension lies outside their last two dims (MoE experts ``[E, M, N]`` sharded on E) are
already whole on every rank and are orthogonalised locally, batched, with no communication. The
others follow the cached :mod:`plan`: packed gather to the owner, NS, packed scatter back, and
under HSDP one sum over the replicate group. Batch k + 1's gather overlaps batch k's NS.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyperparallel.optim.comm import BatchExchange, ShardLayout
from hyperparallel.optim.plan import MatrixSpec, MuonPlan, build_plan

LocalOrthogonalize = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _layout(update: DTensor, name: str) -> ShardLayout:
    mesh, placements = update.device_mesh, tuple(update.placements)
    if mesh.ndim == 1 and placements == (Shard(0),):
        return ShardLayout(
            mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0), None, 0, _device(update)
        )
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        return ShardLayout(
            mesh.get_group(1),
            mesh.get_local_rank(1),
            mesh.size(1),
            mesh.get_group(0),
            mesh.get_local_rank(0),
            _device(update),
        )
    raise ValueError(
        f"parameter {name}: placements {placements} on a {mesh.ndim}-D mesh are not supported; "
        "use fully_shard's Shard(0) (FSDP2) or (Replicate(), Shard(0)) (HSDP)"
    )


def _device(update: DTensor) -> torch.device:
    return update.to_local().device


class ShardedNewtonSchulz:
    """Orthogonalises a step's DTensor updates; the plan is built once per parameter layout.

    Args:
        local_orthogonalize: NS on a list of whole matrices (2-D, or 3-D batches), returning
            them in order; the single-process kernel with its batching and memory cap.
        batch_bytes: most bytes of whole matrices an owner receives per communication batch.
    """

    def __init__(self, local_orthogonalize: LocalOrthogonalize, batch_bytes: int | None = None):
        self.local_orthogonalize = local_orthogonalize
        self.batch_bytes = batch_bytes
        self._plans: dict[tuple, MuonPlan] = {}

    def __call__(self, updates: list[DTensor], params: list[DTensor]) -> list[DTensor]:
        """Return the orthogonalised updates, each sharded exactly like its input.

        Args:
            updates: momentum updates, DTensors shaped and placed like ``params``.
            params: the parameters (their order names them in error messages).
        """
        names = [f"#{i} {tuple(p.shape)}" for i, p in enumerate(params)]
        layouts = [_layout(u, n) for u, n in zip(updates, names, strict=True)]
        meshes = {id(u.device_mesh) for u in updates}
        if len(meshes) > 1:
            raise ValueError(
                f"parameters {names} live on {len(meshes)} different device meshes; distributed "
                "Muon needs one mesh per optimizer (create one optimizer per mesh)"
            )
        results: dict[int, torch.Tensor] = {}
        gathered: list[int] = []
        local_batch: list[int] = []
        for i, update in enumerate(updates):
            # [E, M, N] experts are sharded on E: each rank already holds whole matrices. 2-D
            # and 4-D (conv, flattened to [O, I*kh*kw]) updates are sharded on their rows.
            (local_batch if update.ndim == 3 else gathered).append(i)
        for i in local_batch:
            if updates[i].to_local().numel() == 0:  # fewer experts than ranks
                results[i] = updates[i].to_local()
        todo = [i for i in local_batch if i not in results]
        if todo:
            outs = self.local_orthogonalize([updates[i].to_local() for i in todo])
            results.update(zip(todo, outs, strict=True))
        if gathered:
            results.update(self._gathered(updates, gathered, layouts[gathered[0]]))
        return [
            DTensor.from_local(
                results[i].reshape(u.to_local().shape).to(u.dtype),
                u.device_mesh,
                u.placements,
                run_check=False,
                shape=u.shape,
                stride=u.stride(),
            )
            for i, u in enumerate(updates)
        ]

    def _gathered(
        self, updates: list[DTensor], indices: list[int], layout: ShardLayout
    ) -> dict[int, torch.Tensor]:
        shapes = {i: (updates[i].shape[0], math.prod(updates[i].shape[1:])) for i in indices}
        plan = self._plan(shapes, layout)
        local_rows = {i: updates[i].to_local().reshape(-1, shapes[i][1]).float() for i in indices}
        exchanges = [BatchExchange(batch, local_rows, shapes, layout) for batch in plan.batches]
        results: dict[int, torch.Tensor] = {}
        if exchanges:
            exchanges[0].start_gather()
        for k, exchange in enumerate(exchanges):
            owned = exchange.finish_gather()
            if k + 1 < len(exchanges):
                exchanges[k + 1].start_gather()  # overlaps this batch's NS
            results.update(exchange.scatter(self.local_orthogonalize(owned) if owned else []))
        return results

    def _plan(self, shapes: dict[int, tuple[int, int]], layout: ShardLayout) -> MuonPlan:
        replicas = 1 if layout.replicate_group is None else layout.replicate_group.size()
        key = (tuple(sorted(shapes.items())), layout.shard_size, replicas, self.batch_bytes)
        if key not in self._plans:
            specs = [MatrixSpec(i, rows, cols) for i, (rows, cols) in shapes.items()]
            self._plans[key] = build_plan(specs, layout.shard_size, replicas, self.batch_bytes)
        return self._plans[key]
