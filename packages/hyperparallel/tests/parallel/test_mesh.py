"""The named mesh's sizes, parsing and batch split, and pipeline stage placement (pure Python,
no ranks; building and looking up meshes is in ``tests/distributed/test_mesh_build.py``)."""

from __future__ import annotations

import re

import pytest

from hyperparallel.parallel.mesh import ParallelDims, parse_mesh
from hyperparallel.parallel.pipeline import split_layers, stage_holder, stage_ids


@pytest.mark.parametrize(
    ("mesh", "world", "dims"),
    [
        ("fsdp", 4, ParallelDims(dp_shard=4)),
        ("2x2", 4, ParallelDims(dp_replicate=2, dp_shard=2)),
        ("1X3", 3, ParallelDims(dp_replicate=1, dp_shard=3)),
        ("pp=2,dp_shard=2", 4, ParallelDims(pp=2, dp_shard=2)),
        ("ep=2, dp_shard=2", 4, ParallelDims(ep=2, dp_shard=2)),
        ("dp_replicate=2,dp_shard=2", 4, ParallelDims(dp_replicate=2, dp_shard=2)),
        ("pp=2,ep=2,dp_shard=2", 8, ParallelDims(pp=2, ep=2, dp_shard=2)),
        ("ep=4", 4, ParallelDims(ep=4)),
    ],
)
def test_mesh_forms_and_aliases(mesh, world, dims):
    """Named sizes (any order, unnamed dims 1) and the 'fsdp' / 'RxS' aliases."""
    assert parse_mesh(mesh, world) == dims
    assert dims.world_size == world


def test_data_parallel_ranks_exclude_pp_only():
    """ep and both dp dims take their own share of the batch; pp does not."""
    assert ParallelDims(pp=2, dp_shard=2).dp_size == 2
    assert ParallelDims(dp_replicate=2, ep=2, dp_shard=2).dp_size == 8
    assert ParallelDims(pp=2, ep=2).spec() == "pp=2,ep=2"


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("ring", "'ring' is not dim=size"),
        ("tp=2,dp_shard=2", "'tp=2' is not dim=size; use 'fsdp', 'RxS' or sizes of pp"),
        ("pp=2,pp=2", "dimension pp is given twice"),
        ("pp=0,dp_shard=4", "pp='0' must be a positive integer"),
        ("ep=x", "ep='x' must be a positive integer"),
        ("pp=2,dp_shard=3", "pp=2 x dp_shard=3 = 6 ranks != world size 4"),
        ("2x3", "2 x 3 ranks != world size 4"),
    ],
)
def test_bad_mesh_is_refused_naming_the_dimension(mesh, message):
    """Unknown dims, repeats, non-positive sizes and wrong products name what is wrong."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_mesh(mesh, 4)


def test_stage_placement_loop_and_v():
    """Looped stages for interleaved schedules, a V for dualpipev; the holder inverts it."""
    assert stage_ids("1f1b", 2, 1, 1) == [1]
    assert stage_ids("interleaved_1f1b", 2, 0, 2) == [0, 2]
    assert stage_ids("dualpipev", 2, 0, 2) == [0, 3]
    assert stage_ids("dualpipev", 2, 1, 2) == [1, 2]
    for name in ("interleaved_1f1b", "dualpipev"):
        for rank in range(2):
            for stage in stage_ids(name, 2, rank, 2):
                assert stage_holder(name, 2, stage) == rank


def test_layers_split_contiguously_and_evenly():
    """Earlier stages take the remainder; fewer blocks than stages is refused."""
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match=r"model\.n_layers=1 is fewer than the 2 pipeline stages"):
        split_layers(1, 2)


@pytest.mark.parametrize("size", [0, -2, 1.5, True, "2"])
def test_dims_refuse_a_size_that_is_not_a_positive_integer(size):
    """A layout built in code is checked like a parsed one, naming the dimension."""
    with pytest.raises(ValueError, match=re.escape(f"mesh dimension ep={size!r}: give a positive")):
        ParallelDims(ep=size)


def test_global_batch_splits_over_data_parallel_ranks():
    """global_batch_size / dp ranks per rank; batch_size per rank without it."""
    assert ParallelDims(pp=2, dp_shard=2).local_batch_size(8, 16, 4) == 8
    assert ParallelDims(dp_shard=4).local_batch_size(8, 16, 1) == 4
    assert ParallelDims(dp_shard=4).local_batch_size(3, None, 1) == 3


def test_batch_split_conflicts_name_both_settings():
    """A global batch the data-parallel ranks cannot share, or micro-batches that do not divide
    the local batch under pp, are refused with the mesh named."""
    with pytest.raises(ValueError, match=r"global_batch_size=6 is not divisible by the 4 .* ep=4"):
        ParallelDims(ep=4).local_batch_size(8, 6, 1)
    with pytest.raises(ValueError, match=r"microbatches=3 must divide the 4 .* pp=2,dp_shard=2"):
        ParallelDims(pp=2, dp_shard=2).local_batch_size(4, None, 3)
    assert ParallelDims(dp_shard=4).local_batch_size(4, None, 3) == 4  # no pp: no micro-batches
