"""Packed collectives that move whole matrices to their NS owner and the results back.

One ``all_to_all_single`` per batch and direction carries every matrix of the batch (not one
collective per parameter); row counts come from the plan, so uneven and empty shards need no
padding. With HSDP one ``all_reduce`` over the replicate group shares each replica group's results.
"""

from __future__ import annotations

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

    def scatter(self, results: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Send each rank its rows of the owned results; return this rank's rows of every
        matrix in the batch (all replicas' matrices under HSDP)."""
        layout = self.layout
        send, in_splits = [], []
        for dest in range(layout.shard_size):
            pieces = []
            for index, full in zip(self.owned, results, strict=True):
                start = sum(self._splits[index][:dest])
                pieces.append(full[start : start + self._splits[index][dest]].reshape(-1))
            in_splits.append(sum(p.numel() for p in pieces))
            send.extend(pieces)
        out_splits = [
            sum(self._piece_numel(a.index, layout.shard_rank) for a in self.mine if a.owner == src)
            for src in range(layout.shard_size)
        ]
        dtype = results[0].dtype if results else torch.float32
        received = torch.empty(sum(out_splits), dtype=dtype, device=layout.device)
        dist.all_to_all_single(
            received,
            torch.cat(send) if send else torch.empty(0, dtype=dtype, device=layout.device),
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=layout.shard_group,
        )
        mine = {}
        offset = 0
        for src in range(layout.shard_size):
            for a in self.mine:
                if a.owner == src:
                    numel = self._piece_numel(a.index, layout.shard_rank)
                    rows = self._splits[a.index][layout.shard_rank]
                    cols = self.shapes[a.index][1]
                    mine[a.index] = received[offset : offset + numel].view(rows, cols)
                    offset += numel
        if layout.replicate_group is None:
            return mine
        return self._share_across_replicas(mine, dtype)

    def _share_across_replicas(
        self, mine: dict[int, torch.Tensor], dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        # Every replica holds the same shard rows, so one sum over the replicate group, where
        # each matrix is non-zero in exactly one replica, hands everyone all results.
        indices = sorted(a.index for a in self.batch)
        numels = [self._piece_numel(i, self.layout.shard_rank) for i in indices]
        flat = torch.zeros(sum(numels), dtype=dtype, device=self.layout.device)
        offset = 0
        for index, numel in zip(indices, numels, strict=True):
            if index in mine:
                flat[offset : offset + numel] = mine[index].reshape(-1)
            offset += numel
        dist.all_reduce(flat, group=self.layout.replicate_group)
        out, offset = {}, 0
        for index, numel in zip(indices, numels, strict=True):
            rows = self._splits[index][self.layout.shard_rank]
            out[index] = flat[offset : offset + numel].view(rows, self.shapes[index][1])
            offset += numel
        return out
