"""A differentiable ``all_to_all_single`` split in two: start the exchange, then wait for it.

Between :func:`start_all_to_all` and :func:`wait_all_to_all` the caller computes something
else while the exchange runs (gloo's worker threads, NCCL's stream). Backward mirrors it: the
wait's backward starts the reverse exchange of the gradient and the start's backward waits for
it, so whatever autograd runs between those two nodes overlaps with the reverse exchange.

Every rank of the group must start its exchanges in the same order, forward and backward. In
backward autograd runs the ready nodes of a graph on one device newest first, so the reverse
exchanges start in the reverse of the forward creation order on every rank, whatever the data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PendingExchange:
    """One exchange in flight, shared by the start and wait nodes of forward and backward.

    Args:
        group: the process group of the exchange.
        out_splits: rows this rank receives from each rank.
        in_splits: rows this rank sends to each rank.
    """

    def __init__(
        self, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]
    ) -> None:
        self.group = group
        self.out_splits = out_splits
        self.in_splits = in_splits
        self.work: dist.Work | None = None
        self.sent: torch.Tensor | None = None
        """Kept alive until the exchange is waited for (the collective reads it meanwhile)."""
        self.received: torch.Tensor | None = None

    def launch(self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Start exchanging ``send`` (rows split by ``in_splits``) into a new receive buffer."""
        self.sent = send.contiguous()
        self.received = send.new_empty(sum(out_splits), *send.shape[1:])
        self.work = dist.all_to_all_single(
            self.received,
            self.sent,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=self.group,
            async_op=True,
        )

    def wait(self) -> torch.Tensor:
        """Block until the exchange has arrived; the receive buffer."""
        assert self.work is not None and self.received is not None
        self.work.wait()
        received = self.received
        self.work, self.sent, self.received = None, None, None
        return received


class _Start(torch.autograd.Function):
    """Forward: launch the exchange, return its (not yet filled) receive buffer.
    Backward: wait for the reverse exchange :class:`_Wait` started, return its result."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, pending: PendingExchange) -> torch.Tensor:
        ctx.pending = pending
        pending.launch(send, pending.out_splits, pending.in_splits)
        assert pending.received is not None
        return pending.received

    @staticmethod
    def backward(ctx: Any, _placeholder: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.pending.wait(), None


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange, return the filled buffer.
    Backward: launch the reverse exchange of the gradient; :class:`_Start` waits for it."""

    @staticmethod
    def forward(ctx: Any, received: torch.Tensor, pending: PendingExchange) -> torch.Tensor:
        ctx.pending = pending
        return pending.wait().view_as(received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        pending: PendingExchange = ctx.pending
        pending.launch(grad, pending.in_splits, pending.out_splits)
        # _Start's backward ignores this gradient and returns the reverse exchange's result.
        return grad, None


def start_all_to_all(
    send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> tuple[torch.Tensor, PendingExchange]:
    """Start exchanging ``send: [sum(in_splits), ...]`` over ``group``: rows
    ``in_splits[r]`` go to rank ``r`` and ``out_splits[r]`` rows arrive from it.

    Returns the receive buffer, which must not be read before :func:`wait_all_to_all`, and the
    exchange to wait for.
    """
    pending = PendingExchange(group, out_splits, in_splits)
    buffer: torch.Tensor = _Start.apply(send, pending)
    return buffer, pending


def wait_all_to_all(buffer: torch.Tensor, pending: PendingExchange) -> torch.Tensor:
    """The received rows ``[sum(out_splits), ...]`` of an exchange :func:`start_all_to_all`
    started, once they have arrived (differentiable)."""
    received: torch.Tensor = _Wait.apply(buffer, pending)
    return received
