"""The named mesh built on 4 gloo ranks: each sub-mesh looked up by name holds exactly the ranks
that share this rank's coordinates on the other dimensions (checked against a row-major count
of the ranks, not against torch's DeviceMesh), and the train job's meshes are those sub-meshes."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from hyperparallel.parallel.mesh import FLATTENED_DIMS, MESH_DIMS, ParallelDims
from npu_core.dist import launch

pytestmark = pytest.mark.distributed

WORLD = 4
LAYOUTS = [
    ParallelDims(ep=2, dp_shard=2),
    ParallelDims(dp_replicate=2, dp_shard=2),
    ParallelDims(pp=2, ep=2),
]
LOOKUPS = [
    *((d,) for d in MESH_DIMS),
    ("ep", "dp_shard"),
    ("dp_replicate", "ep"),
    ("pp", "dp_replicate", "ep", "dp_shard"),
    *((name,) for name in FLATTENED_DIMS),
]


def _flat(nested: list | int) -> list[int]:
    if isinstance(nested, int):
        return [nested]
    return [rank for item in nested for rank in _flat(item)]


def _built(layouts: list[ParallelDims]) -> list[dict]:
    """Per layout, this rank's ranks of every looked-up mesh and of the job's meshes."""
    out = []
    for dims in layouts:
        meshes = dims.build("cpu")
        seen = {names: _flat(meshes[names].mesh.tolist()) for names in LOOKUPS}
        refusal = None
        try:
            meshes["tp"]
        except KeyError as exc:
            refusal = str(exc)
        job = {
            "dense": _flat(meshes.dense.mesh.tolist()),
            "dense_names": meshes.dense.mesh_dim_names,
            "experts": None if meshes.experts is None else meshes.experts.mesh_dim_names,
            "ep": None if meshes.ep is None else _flat(meshes.ep.mesh.tolist()),
            "pp": None if meshes.pp is None else _flat(meshes.pp.mesh.tolist()),
        }
        out.append({"seen": seen, "job": job, "dp_rank": meshes.dp_rank, "refusal": refusal})
    try:
        ParallelDims(dp_shard=2).build("cpu")
    except ValueError as exc:
        out.append({"mismatch": str(exc), "rank": dist.get_rank()})
    return out


def _coordinates(dims: ParallelDims) -> list[tuple[int, ...]]:
    """Coordinates of ranks 0..world-1 in row-major order over MESH_DIMS."""
    return list(itertools.product(*(range(getattr(dims, d)) for d in MESH_DIMS)))


def _group(dims: ParallelDims, rank: int, names: tuple[str, ...]) -> list[int]:
    """The ranks that agree with ``rank`` on every dimension outside ``names``."""
    coords = _coordinates(dims)
    fixed = [i for i, d in enumerate(MESH_DIMS) if d not in names]
    return [r for r, c in enumerate(coords) if all(c[i] == coords[rank][i] for i in fixed)]


@pytest.fixture(scope="module")
def per_rank() -> list[list[dict]]:
    return launch(_built, WORLD, LAYOUTS, timeout=300)


def test_lookup_by_name_gives_the_ranks_of_that_dimension(per_rank):
    """``meshes[names]`` is the group of ranks varying only along ``names``; a flattened name
    is the group of the dimensions it flattens."""
    for rank, results in enumerate(per_rank):
        for dims, result in zip(LAYOUTS, results, strict=False):
            for names, ranks in result["seen"].items():
                along = FLATTENED_DIMS.get(names[0], names) if len(names) == 1 else names
                assert ranks == _group(dims, rank, along), (dims, rank, names)


def test_job_meshes_are_the_named_sub_meshes(per_rank):
    """Dense weights shard over ep x dp_shard (HSDP: replicas over dp_replicate); experts sit on
    the mesh of ep and the dp dimensions above 1; the batch index counts the data ranks."""
    for rank, results in enumerate(per_rank):
        ep_fsdp, hsdp, pp_ep = results[:3]
        assert ep_fsdp["job"]["dense"] == list(range(WORLD))
        assert ep_fsdp["job"]["experts"] == ("ep", "dp_shard")
        assert ep_fsdp["job"]["ep"] == _group(LAYOUTS[0], rank, ("ep",))
        assert ep_fsdp["dp_rank"] == rank
        assert hsdp["job"]["dense_names"] == ("dp_replicate", "dp_shard_ep")
        assert hsdp["job"]["experts"] is None and hsdp["job"]["ep"] is None
        assert pp_ep["job"]["pp"] == _group(LAYOUTS[2], rank, ("pp",))
        assert pp_ep["job"]["experts"] == ("ep",)
        assert pp_ep["dp_rank"] == rank % 2  # ranks 0, 1 are pp=0; 2, 3 pp=1


def test_unknown_names_and_wrong_world_sizes_are_refused(per_rank):
    """A name outside the mesh lists the known ones; a layout for another world size says so."""
    result = per_rank[0]
    assert "mesh dimension 'tp': not one of pp, dp_replicate, ep, dp_shard" in result[0]["refusal"]
    assert result[-1]["mismatch"] == "--mesh dp_shard=2: 2 ranks != world size 4"
