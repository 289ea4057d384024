"""Planning of chunked expert dispatch (no ranks): expert groups, pair order, split sizes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from hyperparallel.parallel.dispatch_plan import expert_groups, plan_dispatch, split_local
from hyperparallel.parallel.expert import ExpertDispatchConfig


def test_expert_groups_cover_every_local_expert_once_evenly():
    """Groups are contiguous, cover 0..n_local-1 once, differ in size by one at most, and are
    capped at one expert each."""
    for n_local in range(1, 9):
        for chunks in range(1, 11):
            groups = expert_groups(n_local, chunks)
            covered = [j for g in groups for j in range(g.start, g.stop)]
            assert covered == list(range(n_local))
            assert len(groups) == min(chunks, n_local)
            sizes = [g.stop - g.start for g in groups]
            assert max(sizes) - min(sizes) <= 1
    assert expert_groups(5, 3) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_plan_orders_pairs_by_chunk_then_rank_and_drops_sentinels():
    """ep=2, 4 local experts in 2 chunks: the pairs sent come out chunk-major, then by
    destination rank and expert, ties in token order; the sentinel 8 is not sent; the splits
    are the counts summed per chunk and rank (reference: the same order built by hand)."""
    flat = torch.tensor([5, 0, 8, 2, 7, 0, 4, 1, 6, 8, 3, 5])
    sent = torch.bincount(flat, minlength=8)[:8]
    received = torch.tensor([1, 0, 2, 0, 3, 1, 0, 0])  # [ep=2, n_local=4]
    groups = expert_groups(4, 2)
    plan = plan_dispatch(flat, sent, received, groups)

    def chunk(e: int) -> int:
        return (e % 4) // 2

    valid = [i for i, e in enumerate(flat.tolist()) if e < 8]
    want = sorted(valid, key=lambda i: (chunk(int(flat[i])), int(flat[i]), i))
    assert plan.pairs.tolist() == want
    # chunk 0 holds local experts 0-1: global 0, 1 on rank 0 and 4, 5 on rank 1
    assert plan.send_splits == [[3, 3], [2, 2]]
    assert plan.recv_splits == [[1, 4], [2, 0]]
    assert plan.send_rows == [6, 4]
    assert plan.recv_per_expert == [[4, 1], [2, 0]]  # local experts 0, 1 | 2, 3


def test_local_first_keeps_own_rows_out_of_the_exchange():
    """ep=2, rank 1 of a one-chunk plan: the pairs routed to its experts 4-7 are the local ones
    (by expert), everything else is remote; the exchange's splits are 0 for rank 1 itself and
    the received counts leave its own row out (reference: built by hand from the choices)."""
    flat = torch.tensor([5, 0, 8, 2, 7, 0, 4, 1, 6, 8, 3, 5])
    sent = torch.bincount(flat, minlength=8)[:8]
    # [ep=2, n_local=4]: from rank 0, and from rank 1 itself (its own counts sent[4:])
    received = torch.tensor([1, 0, 2, 0, 1, 2, 1, 1])
    plan = split_local(plan_dispatch(flat, sent, received, expert_groups(4, 1)), rank=1)
    valid = [i for i, e in enumerate(flat.tolist()) if e < 8]
    by_expert = sorted(valid, key=lambda i: (int(flat[i]), i))
    assert plan.local_pairs.tolist() == [i for i in by_expert if flat[i] >= 4]
    assert plan.remote_pairs.tolist() == [i for i in by_expert if flat[i] < 4]
    assert plan.local_per_expert == [1, 2, 1, 1]
    assert plan.send_splits == [5, 0]
    assert plan.recv_splits == [3, 0]
    assert plan.recv_counts.tolist() == [[1, 0, 2, 0], [0, 0, 0, 0]]
    assert plan.recv_per_expert == [1, 0, 2, 0]


def test_local_first_needs_one_chunk():
    """A chunked plan cannot be split local-first, and the config refuses the combination."""
    flat = torch.tensor([0, 5])
    sent = torch.bincount(flat, minlength=8)[:8]
    plan = plan_dispatch(flat, sent, sent, expert_groups(4, 2))
    with pytest.raises(ValueError, match="one-chunk"):
        split_local(plan, rank=0)
    with pytest.raises(ValidationError, match="chunks=1 or local_first=false"):
        ExpertDispatchConfig(chunks=2, local_first=True)


@pytest.mark.parametrize("value", [0, -1, 65, True, 2.5])
def test_dispatch_config_refuses_invalid_chunk_counts(value):
    """chunks is a whole number from 1 to 64; booleans and fractions are refused."""
    with pytest.raises(ValidationError):
        ExpertDispatchConfig(chunks=value)
