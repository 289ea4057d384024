"""Planning of one expert-parallel dispatch: which rows go where, chunk by chunk (no communication).

The local experts of every ep rank are split into the same contiguous groups, the chunks. Chunk
``c`` carries, from every rank to every rank, the (token, slot) pairs routed to the experts of
group ``c`` there; :class:`~hyperparallel.parallel.expert.ExpertParallelDispatch` exchanges and
computes the chunks one after another so that the exchanges overlap with the expert compute.

Local-first dispatch (:func:`split_local`) splits a one-chunk plan differently: the pairs a rank
routes to its own experts never enter the exchange, and are computed while the others travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_groups(n_local: int, chunks: int) -> list[slice]:
    """``min(chunks, n_local)`` contiguous groups of the ``n_local`` local experts, sizes as even
    as possible (the first ones one larger), so that each expert is computed in one call."""
    if n_local < 1 or chunks < 1:
        raise ValueError(f"n_local={n_local} and chunks={chunks} must both be >= 1")
    count = min(chunks, n_local)
    base, extra = divmod(n_local, count)
    groups, start = [], 0
    for c in range(count):
        stop = start + base + (1 if c < extra else 0)
        groups.append(slice(start, stop))
        start = stop
    return groups


@dataclass(frozen=True)
class DispatchPlan:
    """Where this rank's pairs go and what it receives, per chunk.

    Attributes:
        pairs: ``[P]`` indices into the flattened ``[T * k]`` expert choices, ordered by chunk,
            then destination rank, then global expert; skip sentinels (index ``>= E``) left out.
        send_splits: per chunk, the pairs this rank sends to each ep rank.
        recv_splits: per chunk, the rows this rank receives from each ep rank.
        recv_counts: ``[ep, n_local]``, rows rank ``s`` sends to this rank's local expert ``j``.
        recv_per_expert: per chunk, the rows this rank receives for each expert of the chunk,
            all ranks together (on the host, so that computing a chunk needs no device sync).
        recv_table: ``recv_counts`` on the host, ``[ep][n_local]``.
    """

    pairs: torch.Tensor
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    recv_counts: torch.Tensor
    recv_per_expert: list[list[int]]
    recv_table: list[list[int]]

    @property
    def send_rows(self) -> list[int]:
        """Pairs each chunk sends, all ranks together (the split of the send buffer)."""
        return [sum(splits) for splits in self.send_splits]


def plan_dispatch(
    flat_experts: torch.Tensor,
    sent_counts: torch.Tensor,
    received_counts: torch.Tensor,
    groups: list[slice],
) -> DispatchPlan:
    """Plan one dispatch from the counts exchange.

    Args:
        flat_experts: ``[T * k]`` int, the router's choices flattened (sentinels ``>= E``
            allowed).
        sent_counts: ``[E]`` int, pairs this rank routes to each global expert.
        received_counts: ``[E]`` int, laid out ``[ep, n_local]``: rows ep rank ``s`` routes to
            this rank's local expert ``j`` at ``s * n_local + j``.
        groups: the chunks' local-expert groups (:func:`expert_groups`), identical on every rank.
    """
    n_experts = sent_counts.numel()
    n_local = groups[-1].stop
    ep = n_experts // n_local
    recv_counts = received_counts.view(ep, n_local)
    # one host sync for both tables (a device-to-host copy on an accelerator)
    sent_table, recv_table = torch.stack((sent_counts.view(ep, n_local), recv_counts)).tolist()
    chunk_of = torch.empty(n_local, dtype=flat_experts.dtype, device=flat_experts.device)
    for c, group in enumerate(groups):
        chunk_of[group] = c
    # Sort key chunk * E + expert; a sentinel gets a key above every chunk and is cut off below.
    key = torch.where(
        flat_experts < n_experts,
        chunk_of[flat_experts % n_local] * n_experts + flat_experts,
        len(groups) * n_experts,
    )
    send_splits = [[sum(row[g]) for row in sent_table] for g in groups]
    recv_splits = [[sum(row[g]) for row in recv_table] for g in groups]
    per_expert = [sum(column) for column in zip(*recv_table, strict=True)]
    recv_per_expert = [per_expert[g] for g in groups]
    pairs = key.argsort(stable=True)[: sum(map(sum, send_splits))]
    return DispatchPlan(pairs, send_splits, recv_splits, recv_counts, recv_per_expert, recv_table)


@dataclass(frozen=True)
class LocalFirstPlan:
    """One dispatch split into the pairs that stay on this rank and those that travel.

    Attributes:
        local_pairs: ``[L]`` pairs routed to this rank's own experts, ordered by expert.
        local_per_expert: rows of ``local_pairs`` per local expert.
        remote_pairs: ``[P - L]`` the other pairs, ordered by destination rank, then expert.
        send_splits: pairs sent to each ep rank, 0 to this one.
        recv_splits: rows received from each ep rank, 0 from this one.
        recv_counts: ``[ep, n_local]`` rows rank ``s`` sends to this rank's expert ``j``, with
            this rank's row zeroed (its rows do not arrive through the exchange).
        recv_per_expert: rows received per local expert, the other ranks together.
    """

    local_pairs: torch.Tensor
    local_per_expert: list[int]
    remote_pairs: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: torch.Tensor
    recv_per_expert: list[int]


def split_local(plan: DispatchPlan, rank: int) -> LocalFirstPlan:
    """Split a one-chunk ``plan`` at ``rank``, this rank's index in the ep group: its pairs
    are ordered by destination rank, so the local ones are one contiguous run."""
    if len(plan.send_splits) != 1:
        raise ValueError(
            f"local-first dispatch needs a one-chunk plan, got {len(plan.send_splits)}"
        )
    (send_splits,), (recv_splits,) = plan.send_splits, plan.recv_splits
    start = sum(send_splits[:rank])
    stop = start + send_splits[rank]
    local_per_expert = plan.recv_table[rank]
    recv_counts = plan.recv_counts.clone()
    recv_counts[rank] = 0
    return LocalFirstPlan(
        local_pairs=plan.pairs[start:stop],
        local_per_expert=local_per_expert,
        remote_pairs=torch.cat((plan.pairs[:start], plan.pairs[stop:])),
        send_splits=[0 if r == rank else n for r, n in enumerate(send_splits)],
        recv_splits=[0 if r == rank else n for r, n in enumerate(recv_splits)],
        recv_counts=recv_counts,
        recv_per_expert=[
            total - local
            for total, local in zip(plan.recv_per_expert[0], local_per_expert, strict=True)
        ],
    )
