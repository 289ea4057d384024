"""Sub-meshes of the job's named ``DeviceMesh`` for each parallelism (built on every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from hyperparallel.parallel.dims import ParallelDims


@dataclass(frozen=True)
class MeshSet:
    """The meshes one rank needs.

    Attributes:
        dims: the layout.
        world: the 4-D ``(pp, dp_replicate, ep, dp_shard)`` mesh.
        dense: FSDP (1-D, shards over ``ep x dp_shard``) or HSDP (2-D, ``dp_replicate`` first)
            mesh of the non-expert weights; under EP also of nothing else.
        experts: under EP, the mesh the ``[E, M, N]`` experts are placed on (``dp_replicate`` if
            above 1, ``ep``, ``dp_shard`` if above 1); None without EP (FSDP shards them on E).
        ep: the 1-D expert-parallel mesh (token all-to-all), None without EP.
        pp: the 1-D pipeline mesh (stage send/recv), None without PP.
        dp_rank: this rank's index among the data-parallel ranks (its share of the batch).
        pp_rank: this rank's pipeline coordinate.
    """

    dims: ParallelDims
    world: DeviceMesh
    dense: DeviceMesh
    experts: DeviceMesh | None
    ep: DeviceMesh | None
    pp: DeviceMesh | None
    dp_rank: int
    pp_rank: int

    @classmethod
    def from_world(cls, world: DeviceMesh, dims: ParallelDims) -> MeshSet:
        """Slice and flatten ``world`` (named ``pp, dp_replicate, ep, dp_shard``)."""
        shard = world["ep", "dp_shard"]._flatten("dp_shard_ep")
        dense = world["dp_replicate", "dp_shard_ep"] if dims.dp_replicate > 1 else shard
        experts = None
        if dims.ep > 1:
            names = [
                d for d in ("dp_replicate", "ep", "dp_shard") if d == "ep" or getattr(dims, d) > 1
            ]
            experts = world[tuple(names)] if len(names) > 1 else world["ep"]
        data = world["dp_replicate", "ep", "dp_shard"]._flatten("dp")
        return cls(
            dims=dims,
            world=world,
            dense=dense,
            experts=experts,
            ep=world["ep"] if dims.ep > 1 else None,
            pp=world["pp"] if dims.pp > 1 else None,
            dp_rank=data.get_local_rank(),
            pp_rank=world["pp"].get_local_rank(),
        )
