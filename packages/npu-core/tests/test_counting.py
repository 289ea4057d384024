"""npu_core.dist.counting: kinds, groups and bytes of collectives issued on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from npu_core.dist import launch
from npu_core.dist.counting import (
    CollectiveCall,
    CollectiveLog,
    CollectiveTotal,
    count_collectives,
)

pytestmark = pytest.mark.distributed

F32 = 4


def test_totals_sum_calls_and_bytes_per_kind_and_group():
    """totals() adds up the calls of one kind on one group and keeps the others apart."""
    log = CollectiveLog(
        [
            CollectiveCall("all_gather", "c10d::_allgather_base_", (0, 1), 16),
            CollectiveCall("all_gather", "c10d::_allgather_base_", (0, 1), 8),
            CollectiveCall("all_gather", "c10d::_allgather_base_", (0, 2), 4),
            CollectiveCall("send", "c10d::send", (0, 1), 12, peer=1),
        ]
    )
    assert log.totals() == {
        ("all_gather", (0, 1)): CollectiveTotal(calls=2, bytes=24),
        ("all_gather", (0, 2)): CollectiveTotal(calls=1, bytes=4),
        ("send", (0, 1)): CollectiveTotal(calls=1, bytes=12),
    }


def _eager_collectives() -> list[CollectiveCall]:
    world = dist.get_world_size()
    x = torch.ones(6)
    with count_collectives() as log:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(6 * world), x)
        dist.reduce_scatter_tensor(torch.empty(6 // world), x)
        dist.all_to_all_single(torch.empty(6), x)
        dist.broadcast(torch.ones(5, dtype=torch.float64), src=0)
        dist.all_gather([torch.empty(3) for _ in range(world)], torch.ones(3))
    dist.all_reduce(x)  # after the block: not counted
    return log.calls


def test_eager_collectives_are_counted_with_input_bytes():
    """Each eager collective is one call of its kind on the world group, with its input's bytes."""
    calls = launch(_eager_collectives, 2)
    world = (0, 1)
    expected = [
        ("all_reduce", world, 6 * F32, None),
        ("all_gather", world, 6 * F32, None),
        ("reduce_scatter", world, 6 * F32, None),
        ("all_to_all", world, 6 * F32, None),
        ("broadcast", world, 5 * 8, None),
        ("all_gather", world, 3 * F32, None),
    ]
    for rank_calls in calls:
        assert [(c.kind, c.group, c.bytes, c.peer) for c in rank_calls] == expected


def _subgroup_and_p2p() -> list[CollectiveCall]:
    rank = dist.get_rank()
    pair = dist.new_group([1, 2])
    with count_collectives() as log:
        if rank in (1, 2):
            dist.all_reduce(torch.ones(4), group=pair)
        if rank == 0:
            dist.send(torch.ones(7), dst=2)
        if rank == 2:
            dist.recv(torch.empty(7), src=0)
        # a ring of batched P2P: each rank sends 2 floats right and receives 2 from the left
        world = dist.get_world_size()
        ops = [
            dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % world),
            dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return log.calls


def test_subgroups_and_point_to_point_name_global_ranks():
    """A subgroup is named by its global ranks; send/recv name the global peer and their bytes."""
    calls = launch(_subgroup_and_p2p, 3)
    world = (0, 1, 2)
    ring = [("send", world, 2 * F32), ("recv", world, 2 * F32)]
    assert [(c.kind, c.group, c.bytes, c.peer) for c in calls[0]] == [
        ("send", world, 7 * F32, 2),
        ("send", world, 2 * F32, 1),
        ("recv", world, 2 * F32, 2),
    ]
    assert [(c.kind, c.group, c.bytes) for c in calls[1]] == [
        ("all_reduce", (1, 2), 4 * F32),
        *ring,
    ]
    assert [(c.kind, c.group, c.bytes, c.peer) for c in calls[2]] == [
        ("all_reduce", (1, 2), 4 * F32, None),
        ("recv", world, 7 * F32, 0),
        ("send", world, 2 * F32, 0),
        ("recv", world, 2 * F32, 1),
    ]


def _functional_and_dtensor() -> list[tuple[str, tuple[int, ...], int]]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    square = torch.arange(4 * 4, dtype=torch.float32).reshape(4, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    rows, cols = (distribute_tensor(square, mesh, [Shard(d)]) for d in (0, 1))
    with count_collectives() as log:
        reduced = funcol.all_reduce(torch.ones(5), "sum", mesh)
        funcol.wait_tensor(reduced)
        gathered = sharded.full_tensor()  # DTensor's redistribute: one all-gather of the shard
        summed = (rows + cols).full_tensor()  # an aten op on DTensors that must move one input
    assert torch.equal(gathered, full)
    assert torch.equal(summed, 2 * square)
    return [(c.kind, c.group, c.bytes) for c in log.calls]


def test_functional_and_dtensor_collectives_are_counted():
    """Functional collectives, DTensor's redistribution and its op dispatch are all seen."""
    for calls in launch(_functional_and_dtensor, 2):
        world = (0, 1)
        assert calls[:2] == [("all_reduce", world, 5 * F32), ("all_gather", world, 4 * 3 * F32)]
        # rows + cols: one input re-sharded (its local [2, 4] or [4, 2] block moves), then
        # the [2, 4] result's all-gather
        assert len(calls) == 4
        assert calls[2][1:] == (world, 2 * 4 * F32)
        assert calls[3] == ("all_gather", world, 2 * 4 * F32)


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


def _backward_and_objects() -> list[tuple[str, int]]:
    w = torch.ones(3, 4, requires_grad=True)
    with count_collectives() as log:
        _AllReduceGrad.apply(w).sum().backward()
        objects: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(objects, {"rank": dist.get_rank()})
    return [(c.kind, c.bytes) for c in log.calls]


def test_backward_collectives_counted_and_object_collectives_kept_apart():
    """A collective in backward is counted; an object collective's exchanges are kind 'object'."""
    for kinds in launch(_backward_and_objects, 2):
        assert kinds[0] == ("all_reduce", 3 * 4 * F32)
        assert len(kinds) > 1
        assert {kind for kind, _ in kinds[1:]} == {"object"}
