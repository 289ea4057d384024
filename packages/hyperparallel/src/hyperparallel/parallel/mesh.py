"""The named device mesh of a training job: ``pp``, ``dp_replicate``, ``ep``, ``dp_shard``.

This is the one module that knows the mesh: it parses and validates the sizes, splits the global
batch over the data-parallel ranks, builds the ``DeviceMesh`` and looks sub-meshes up by name,
for the train job, the models, the tests and the benchmarks alike (as torchtitan's ParallelDims).

``--mesh pp=2,dp_shard=2`` names each dimension's size; unnamed ones are 1 and the product must be
the world size. ``fsdp`` (all ranks in ``dp_shard``) and ``RxS`` (HSDP: ``dp_replicate=R,
dp_shard=S``) stay as aliases. Every rank outside ``pp`` is a data-parallel rank: ``ep`` splits
the experts, while the dense weights are sharded over ``ep x dp_shard`` and the batch over
``dp_replicate x ep x dp_shard``. Parsing is pure Python (checked before ranks start); only
:meth:`ParallelDims.build` imports ``torch.distributed``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # parsing stays pure Python: torch.distributed is imported by build() alone
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "ep", "dp_shard")
"""Mesh dimensions, outermost first (``dp_shard`` innermost: its collectives are the busiest)."""

FLATTENED_DIMS = {"dp_shard_ep": ("ep", "dp_shard"), "dp": ("dp_replicate", "ep", "dp_shard")}
"""Flattened dimensions :meth:`ParallelDims.build` adds: the dense weights' shard group and the
data-parallel group (each a 1-D mesh over the named dimensions)."""

_HSDP = re.compile(r"^(\d+)x(\d+)$")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the named mesh dimensions; their product is the world size.

    Raises:
        ValueError: a size that is not a positive integer (naming the dimension).
    """

    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    dp_shard: int = 1

    def __post_init__(self) -> None:
        for field in fields(self):
            size = getattr(self, field.name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {field.name}={size!r}: give a positive integer")

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

    def local_batch_size(
        self, batch_size: int, global_batch_size: int | None, microbatches: int
    ) -> int:
        """Samples per data-parallel rank per step; ``global_batch_size``, when set, is split
        over the ``dp_replicate x ep x dp_shard`` data-parallel ranks.

        Raises:
            ValueError: a global batch not divisible by the data-parallel ranks, or (under PP)
                a local batch not divisible by ``microbatches``; the message names both.
        """
        local = batch_size
        if global_batch_size is not None:
            if global_batch_size % self.dp_size:
                raise ValueError(
                    f"data.global_batch_size={global_batch_size} is not divisible by the "
                    f"{self.dp_size} data-parallel ranks of --mesh {self.spec()}"
                )
            local = global_batch_size // self.dp_size
        if self.pp > 1 and local % microbatches:
            raise ValueError(
                f"parallel.microbatches={microbatches} must divide the {local} samples per "
                f"data-parallel rank under --mesh {self.spec()}"
            )
        return local

    def build(self, device_type: str) -> MeshSet:
        """Create the world's ``DeviceMesh`` (joining the default process group, which
        ``init_device_mesh`` creates from the launch environment when there is none yet) and the
        sub-meshes each parallelism uses.

        Raises:
            ValueError: the sizes' product is not the process group's world size.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"--mesh {self.spec()}: {self.world_size} ranks != world size "
                f"{dist.get_world_size()}"
            )
        sizes = tuple(getattr(self, d) for d in MESH_DIMS)
        world = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        return MeshSet.from_world(world, self)


@dataclass(frozen=True)
class MeshSet:
    """The meshes one rank needs: the ones the train job's parallelisms take as attributes, any
    other by name (``meshes["ep", "dp_shard"]``, ``meshes["dp"]``).

    Attributes:
        dims: the layout.
        world: the 4-D ``(pp, dp_replicate, ep, dp_shard)`` mesh.
        flattened: the 1-D meshes of :data:`FLATTENED_DIMS`, by name.
        dense: FSDP (1-D, shards over ``ep x dp_shard``) or HSDP (2-D, ``dp_replicate`` first)
            mesh of the non-expert weights.
        experts: under EP, the mesh the ``[E, M, N]`` experts are placed on (``dp_replicate`` if
            above 1, ``ep``, ``dp_shard`` if above 1); None without EP (FSDP shards them on E).
        ep: the 1-D expert-parallel mesh (token all-to-all), None without EP.
        pp: the 1-D pipeline mesh (stage send/recv), None without PP.
        dp_rank: this rank's index among the data-parallel ranks (its share of the batch).
        pp_rank: this rank's pipeline coordinate.
    """

    dims: ParallelDims
    world: DeviceMesh
    flattened: dict[str, DeviceMesh]
    dense: DeviceMesh
    experts: DeviceMesh | None
    ep: DeviceMesh | None
    pp: DeviceMesh | None
    dp_rank: int
    pp_rank: int

    @classmethod
    def from_world(cls, world: DeviceMesh, dims: ParallelDims) -> MeshSet:
        """Flatten ``world`` (named :data:`MESH_DIMS`) into :data:`FLATTENED_DIMS` and slice the
        meshes each parallelism takes (once, so every user shares the same mesh objects)."""
        flat = {name: world[names]._flatten(name) for name, names in FLATTENED_DIMS.items()}
        dense = (
            world["dp_replicate", "dp_shard_ep"] if dims.dp_replicate > 1 else flat["dp_shard_ep"]
        )
        experts = None
        if dims.ep > 1:
            names = [
                d for d in ("dp_replicate", "ep", "dp_shard") if d == "ep" or getattr(dims, d) > 1
            ]
            experts = world[tuple(names)] if len(names) > 1 else world["ep"]
        return cls(
            dims=dims,
            world=world,
            flattened=flat,
            dense=dense,
            experts=experts,
            ep=world["ep"] if dims.ep > 1 else None,
            pp=world["pp"] if dims.pp > 1 else None,
            dp_rank=flat["dp"].get_local_rank(),
            pp_rank=world["pp"].get_local_rank(),
        )

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over ``names``: one name or several (in :data:`MESH_DIMS` order), or one
        flattened name.

        Raises:
            KeyError: a name that is neither a mesh dimension nor a flattened one.
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        for name in wanted:
            if name not in MESH_DIMS and name not in self.flattened:
                known = ", ".join((*MESH_DIMS, *self.flattened))
                raise KeyError(f"mesh dimension {name!r}: not one of {known}")
        if len(wanted) > 1:
            return self.world[wanted]
        if wanted[0] in self.flattened:  # kept from _flatten: torch deprecates re-slicing them
            return self.flattened[wanted[0]]
        return self.world[wanted[0]]


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
