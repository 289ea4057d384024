"""Muon's ownership plan: every matrix exactly once, balanced, deterministic, batched by bytes."""

from __future__ import annotations

import random

import pytest

from hyperparallel.optim.plan import MatrixSpec, build_plan, shard_rows, spread_over_replicas


@pytest.mark.parametrize(
    ("rows", "shards", "expected"),
    [
        (8, 4, [2, 2, 2, 2]),
        (5, 4, [2, 2, 1, 0]),
        (3, 4, [1, 1, 1, 0]),
        (1, 3, [1, 0, 0]),
        (0, 2, [0, 0]),
    ],
)
def test_shard_rows_follows_chunk_semantics(rows, shards, expected):
    """Uneven and empty shards follow torch.chunk, as FSDP2's Shard(0) does."""
    assert shard_rows(rows, shards) == expected


def _specs(shapes):
    return [MatrixSpec(i, m, n) for i, (m, n) in enumerate(shapes)]


@pytest.mark.parametrize(("shard_size", "replicate_size"), [(1, 1), (4, 1), (2, 2), (3, 2)])
def test_each_matrix_has_exactly_one_owner(shard_size, replicate_size):
    """No NS runs twice in the job, and none is forgotten."""
    rng = random.Random(0)
    specs = _specs([(rng.randint(1, 64), rng.randint(1, 64)) for _ in range(37)])
    plan = build_plan(specs, shard_size, replicate_size)
    indices = [a.index for a in plan.assignments]
    assert sorted(indices) == list(range(37))
    assert all(
        0 <= a.owner < shard_size and 0 <= a.replica < replicate_size for a in plan.assignments
    )


def test_greedy_plan_balances_equal_matrices_perfectly():
    """Eight equal matrices on 2 x 2 slots: two each."""
    plan = build_plan(_specs([(32, 32)] * 8), shard_size=2, replicate_size=2)
    assert plan.imbalance() == pytest.approx(1.0)


def test_largest_matrix_goes_alone_when_it_dominates():
    """Largest first: the big matrix gets a slot to itself; small ones share the others."""
    plan = build_plan(_specs([(256, 256), (8, 8), (8, 8), (8, 8)]), shard_size=2)
    owner_of = {a.index: a.owner for a in plan.assignments}
    assert all(owner_of[i] != owner_of[0] for i in (1, 2, 3))


def test_plan_is_deterministic_and_independent_of_input_order():
    """Every rank derives the same plan, whatever order it listed the parameters in."""
    specs = _specs([(16, 8), (8, 16), (16, 8), (4, 4), (32, 2)])
    first = build_plan(specs, shard_size=3)
    assert build_plan(list(reversed(specs)), shard_size=3) == first


def test_batch_bytes_caps_each_owners_share_per_batch():
    """A byte budget cuts an owner's matrices into several batches; big ones go alone."""
    specs = _specs([(16, 16)] * 6 + [(64, 64)])
    plan = build_plan(specs, shard_size=1, batch_bytes=2 * 16 * 16 * 4)
    sizes = [sum(specs[a.index].nbytes for a in batch) for batch in plan.batches]
    assert len(plan.batches) >= 4
    assert all(
        size <= 2 * 16 * 16 * 4 or len(batch) == 1
        for size, batch in zip(sizes, plan.batches, strict=True)
    )
    assert sorted(a.index for a in plan.assignments) == list(range(7))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shard_size": 0},
        {"shard_size": 2, "replicate_size": 0},
        {"shard_size": 2, "batch_bytes": 0},
    ],
)
def test_build_plan_rejects_bad_sizes(kwargs):
    """Sizes below one are refused with the argument named."""
    with pytest.raises(ValueError, match="must be"):
        build_plan(_specs([(4, 4)]), **kwargs)


def test_spread_over_replicas_balances_with_the_dense_load():
    """Local experts go to the least-loaded replica, counting the dense work it already has."""
    assert spread_over_replicas([4, 4, 4, 4], 2) == (0, 1, 0, 1)
    # Replica 0 already carries 8: the first two experts go to replica 1.
    assert spread_over_replicas([4, 4, 4, 4], 2, start_load=[8, 0]) == (1, 1, 0, 1)
    # Largest first: 9 -> 0, 5 -> 1, 3 -> 2, then the ones to the least loaded (2, 2, 1).
    assert spread_over_replicas([9, 1, 1, 1, 5, 3], 3) == (0, 2, 2, 1, 1, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"replicate_size": 0}, "replicate_size"), ({"start_load": [1]}, "one per replica")],
)
def test_spread_over_replicas_rejects_bad_sizes(kwargs, match):
    """Bad replica counts and a start load of the wrong length are refused by name."""
    args = {"costs": [1, 2], "replicate_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        spread_over_replicas(**args)
