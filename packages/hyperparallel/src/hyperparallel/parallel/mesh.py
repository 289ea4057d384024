"""The named device mesh of a training job: ``pp``, ``dp_replicate``, ``ep``, ``dp_shard``.

``--mesh pp=2,dp_shard=2`` names each dimension's size; unnamed ones are 1 and the product must be
the world size. ``fsdp`` (all ranks in ``dp_shard``) and ``RxS`` (HSDP: ``dp_replicate=R,
dp_shard=S``) stay as aliases. As in torchtitan's ParallelDims, every rank outside ``pp`` is a data
parallel rank: ``ep`` splits the experts, while the dense weights are sharded over ``ep x dp_shard``
and the batch over ``dp_replicate x ep x dp_shard``. Parsing is pure Python (checked before ranks
start); :meth:`ParallelDims.build` creates the ``DeviceMesh`` and the :class:`MeshSet` of
sub-meshes each parallelism looks up by name. This is the one module that knows the mesh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # parsing stays pure Python: torch.distributed is imported by build() alone
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "ep", "dp_shard")
"""Mesh dimensions, outermost first (``dp_shard`` innermost: its collectives are the busiest)."""

_HSDP = re.compile(r"^(\d+)x(\d+)$")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the named mesh dimensions; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    dp_shard: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.ep * self.dp_shard

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each takes its own share of the global batch."""
        return self.dp_replicate * self.ep * self.dp_shard

    def spec(self) -> str:
        """The canonical ``--mesh`` text of this layout (sizes above 1, outermost first)."""
        parts = [f"{d}={getattr(self, d)}" for d in MESH_DIMS if getattr(self, d) > 1]
        return ",".join(parts) or "dp_shard=1"

    def build(self, device_type: str) -> MeshSet:
        """Create the world's ``DeviceMesh`` and the sub-meshes each parallelism uses.

        Returns:
            ``MeshSet`` with ``dense`` (FSDP/HSDP of the non-expert weights: shards over
            ``ep x dp_shard``, replicas over ``dp_replicate``), ``experts`` (``[E, M, N]``
            placement mesh under EP, else None), ``ep`` / ``pp`` (1-D, or None when of size 1),
            and ``dp_rank`` (this rank's share of the global batch).
        """
        from torch.distributed.device_mesh import init_device_mesh

        sizes = tuple(getattr(self, d) for d in MESH_DIMS)
        world = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        return MeshSet.from_world(world, self)


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


def parse_mesh(text: str, world_size: int) -> ParallelDims:
    """``"pp=2,dp_shard=2"`` / ``"fsdp"`` / ``"2x2"`` -> :class:`ParallelDims` for ``world_size``.

    Raises:
        ValueError: naming the dimension or the form that is wrong and what is allowed.
    """
    spec = text.strip().lower()
    if spec == "fsdp":
        return ParallelDims(dp_shard=world_size)
    hsdp = _HSDP.match(spec)
    if hsdp:
        replicate, shard = int(hsdp.group(1)), int(hsdp.group(2))
        if replicate < 1 or shard < 1 or replicate * shard != world_size:
            raise ValueError(
                f"--mesh {text}: {replicate} x {shard} ranks != world size {world_size}; "
                f"choose R x S with R * S = {world_size}"
            )
        return ParallelDims(dp_replicate=replicate, dp_shard=shard)
    sizes: dict[str, int] = {}
    for item in spec.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in MESH_DIMS:
            raise ValueError(
                f"--mesh {text!r}: {item.strip()!r} is not dim=size; use 'fsdp', 'RxS' or "
                f"sizes of {', '.join(MESH_DIMS)} (e.g. 'pp=2,dp_shard=2')"
            )
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: dimension {name} is given twice")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: {name}={value!r} must be a positive integer")
        sizes[name] = int(value)
    dims = ParallelDims(**sizes)
    if dims.world_size != world_size:
        product = " x ".join(f"{d}={getattr(dims, d)}" for d in MESH_DIMS if d in sizes)
        raise ValueError(
            f"--mesh {text}: {product} = {dims.world_size} ranks != world size {world_size}; "
            f"make the product {world_size} (dimensions not named are 1)"
        )
    return dims
