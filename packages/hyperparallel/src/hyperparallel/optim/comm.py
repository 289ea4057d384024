"""Packed collectives that move whole matrices to their NS owner and the results back.

One ``all_to_all_single`` per batch and direction carries every matrix of the batch (not one
collective per parameter); row counts come from the plan, so uneven and empty shards need no
padding. With HSDP one ``all_reduce`` over the replicate group shares each replica group's results.
Every collective can be started and finished apart, so the caller overlaps it with NS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyperparallel.optim.plan import Assignment, shard_rows


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank sits: shard group (FSDP) and replicate group (HSDP, else None)."""

    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None
    replica: int
    device: torch.device


class BatchExchange:
    """Gather, then scatter, one batch of matrices between shard ranks and their owners.

    Args:
        batch: the batch's assignments (all replicas; only this rank's replica moves here).
        local_rows: this rank's rows of each matrix, ``[rows_here, cols]``, by index.
        shapes: global ``(rows, cols)`` of each matrix, by index.
        layout: this rank's groups.
    """

    def __init__(
        self,
        batch: tuple[Assignment, ...],
        local_rows: dict[int, torch.Tensor],
        shapes: dict[int, tuple[int, int]],
        layout: ShardLayout,
    ) -> None:
        self.layout = layout
        self.shapes = shapes
        self.mine = [a for a in batch if a.replica == layout.replica]
        self.owned = [a.index for a in self.mine if a.owner == layout.shard_rank]
        self.batch = batch
        self.local_rows = local_rows
        self._splits = {index: shard_rows(shapes[index][0], layout.shard_size) for index in shapes}
        self._gather_work: dist.Work | None = None
        self._received: torch.Tensor | None = None

    def _piece_numel(self, index: int, shard_rank: int) -> int:
        return self._splits[index][shard_rank] * self.shapes[index][1]

    def start_gather(self) -> None:
        """Send each owner this rank's rows of its matrices (asynchronously)."""
        layout = self.layout
        send, in_splits = [], []
        for dest in range(layout.shard_size):
            pieces = [self.local_rows[a.index].reshape(-1) for a in self.mine if a.owner == dest]
            in_splits.append(sum(p.numel() for p in pieces))
            send.extend(pieces)
        out_splits = [
            sum(self._piece_numel(index, src) for index in self.owned)
            for src in range(layout.shard_size)
        ]
        send_buffer = torch.cat(send) if send else torch.empty(0, device=layout.device)
        self._received = torch.empty(sum(out_splits), dtype=send_buffer.dtype, device=layout.device)
        self._gather_work = dist.all_to_all_single(
            self._received,
            send_buffer,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=layout.shard_group,
            async_op=True,
        )

    def finish_gather(self) -> list[torch.Tensor]:
        """Wait for the gather; return the full ``[rows, cols]`` matrices this rank owns."""
        assert self._gather_work is not None and self._received is not None
        self._gather_work.wait()
        pieces: dict[int, list[torch.Tensor]] = {index: [] for index in self.owned}
        offset = 0
        for src in range(self.layout.shard_size):
            for index in self.owned:
                numel = self._piece_numel(index, src)
                pieces[index].append(self._received[offset : offset + numel])
                offset += numel
        return [torch.cat(pieces[i]).view(self.shapes[i]) for i in self.owned]

    def start_scatter(self, results: list[torch.Tensor]) -> None:
        """Send each rank its rows of the owned results (asynchronously)."""
        layout = self.layout
        send, in_splits = [], []
        for dest in range(layout.shard_size):
            pieces = []
            for index, full in zip(self.owned, results, strict=True):
                start = sum(self._splits[index][:dest])
                pieces.append(full[start : start + self._splits[index][dest]].reshape(-1))
            in_splits.append(sum(p.numel() for p in pieces))
            send.extend(pieces)
        self._out_splits = [
            sum(self._piece_numel(a.index, layout.shard_rank) for a in self.mine if a.owner == src)
            for src in range(layout.shard_size)
        ]
        self._dtype = results[0].dtype if results else torch.float32
        self._scattered = torch.empty(
            sum(self._out_splits), dtype=self._dtype, device=layout.device
        )
        work = dist.all_to_all_single(
            self._scattered,
            torch.cat(send) if send else torch.empty(0, dtype=self._dtype, device=layout.device),
            output_split_sizes=self._out_splits,
            input_split_sizes=in_splits,
            group=layout.shard_group,
            async_op=True,
        )
        assert work is not None  # async_op=True always returns the Work handle
        self._scatter_work = work
        self._share: ReplicaShare | None = None
        self._mine: dict[int, torch.Tensor] | None = None

    @property
    def shares_across_replicas(self) -> bool:
        """Whether finishing needs a second collective (HSDP's replica all-reduce)."""
        return self.layout.replicate_group is not None

    def finish_scatter(self) -> None:
        """Wait for the scatter; under HSDP start the replica all-reduce. Idempotent."""
        if self._mine is not None:
            return
        self._scatter_work.wait()
        layout = self.layout
        mine = {}
        offset = 0
        for src in range(layout.shard_size):
            for a in self.mine:
                if a.owner == src:
                    numel = self._piece_numel(a.index, layout.shard_rank)
                    rows = self._splits[a.index][layout.shard_rank]
                    cols = self.shapes[a.index][1]
                    mine[a.index] = self._scattered[offset : offset + numel].view(rows, cols)
                    offset += numel
        self._mine = mine
        if layout.replicate_group is not None:
            # Every replica holds the same shard rows, so one sum over the replicate group,
            # where each matrix is non-zero in exactly one replica, hands everyone all results.
            indices = sorted(a.index for a in self.batch)
            local_rows = {i: self._splits[i][layout.shard_rank] for i in indices}
            shapes = {i: (local_rows[i], self.shapes[i][1]) for i in indices}
            self._share = ReplicaShare(
                mine, shapes, self._dtype, layout.replicate_group, layout.device
            )

    def finish(self) -> dict[int, torch.Tensor]:
        """This rank's rows of every matrix in the batch (all replicas' matrices under HSDP)."""
        self.finish_scatter()
        assert self._mine is not None
        return self._mine if self._share is None else self._share.wait()

    def scatter(self, results: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """:meth:`start_scatter` and :meth:`finish` back to back (no overlap)."""
        self.start_scatter(results)
        return self.finish()


class ReplicaShare:
    """One asynchronous sum over a replicate group of a flat buffer where each matrix is
    non-zero on exactly one replica: afterwards every replica holds every result exactly (adding
    zeros is exact).

    Args:
        mine: this replica's results, by index (a subset of ``shapes``).
        shapes: every shared matrix's local shape, by index; the buffer follows sorted indices.
        dtype: the results' dtype.
        group: the replicate group.
        device: where the buffer lives.
    """

    def __init__(
        self,
        mine: dict,
        shapes: dict,
        dtype: torch.dtype,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.shapes = dict(sorted(shapes.items()))
        numels = [math.prod(s) for s in self.shapes.values()]
        self.flat = torch.zeros(sum(numels), dtype=dtype, device=device)
        offset = 0
        for index, numel in zip(self.shapes, numels, strict=True):
            if index in mine:
                self.flat[offset : offset + numel] = mine[index].reshape(-1)
            offset += numel
        self._work = dist.all_reduce(self.flat, group=group, async_op=True)

    def wait(self) -> dict:
        """Every shared matrix, by index (views into one buffer)."""
        self._work.wait()
        out, offset = {}, 0
        for index, shape in self.shapes.items():
            numel = math.prod(shape)
            out[index] = self.flat[offset : offset + numel].view(shape)
            offset += numel
        return out
