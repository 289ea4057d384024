"""A step-time estimate from a device profile: compute at an achievable rate plus the
communication that does not hide behind it.

The model, and what it assumes:

- Compute is the forward FLOPs of each block the rank holds, measured on the meta device
  (:mod:`~hyperparallel.plan.activations`: matmuls, attention at half the square under a causal
  mask, experts at balanced routing), times 3 for forward and backward, plus one more forward
  for blocks under the ``recompute`` policy (``selective`` replays no matmul), plus the head's
  matmul on the last stage; it runs at ``efficiency`` times the profile's peak for the
  parameters' dtype (1.0 for a measured profile, whose rate is already achieved).
- Communication time is wire bytes over the link bandwidth of the group: the intra-node link
  when the group's ranks share a node (ranks fill nodes in order), else the network. Wire bytes
  per rank follow ring algorithms: an all-gather sends ``(n - 1)`` times its shard, a
  reduce-scatter and an all-to-all ``(n - 1) / n`` of their input, an all-reduce twice that,
  a send its tensor.
- FSDP's gathers and reduce-scatters overlap the compute (prefetch); expert all-to-alls and
  pipeline sends are exposed (the job's default dispatch is blocking); under pp the 1F1B bubble
  adds ``(pp - 1) / microbatches`` of the compute; Muon's gathers and scatters overlap its
  Newton-Schulz, whose time is the most-loaded rank's FLOPs at the bf16 rate (the job's ``auto``
  NS dtype on accelerators; fp32 on a CPU).

Latency, kernel launch overheads, congestion and stragglers are left out: the estimate is a
lower bound of the kind that ranks layouts, not a prediction to the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyperparallel.parallel.mesh import FLATTENED_DIMS, MESH_DIMS
from hyperparallel.plan.activations import BlockMeasure
from hyperparallel.plan.collectives import CollectiveBytes
from hyperparallel.plan.inventory import Inventory, mesh_coords
from hyperparallel.plan.muon_work import NSWork
from hyperparallel.plan.profiles import DeviceProfile

OVERLAPPED = frozenset({"fsdp", "hsdp"})
"""Sources whose collectives hide behind the compute."""


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one training step on one rank, by part.

    Attributes:
        compute: forward, backward and recompute of the rank's blocks and head.
        overlapped_comm: FSDP / HSDP collectives (hidden up to the compute time).
        exposed_comm: expert all-to-alls, pipeline sends and other collectives.
        bubble: the pipeline's idle time.
        optimizer: Newton-Schulz of the most-loaded rank, or Muon's communication if longer.
    """

    compute: float
    overlapped_comm: float
    exposed_comm: float
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return (
            max(self.compute, self.overlapped_comm)
            + self.exposed_comm
            + self.bubble
            + self.optimizer
        )


def forward_flops(inv: Inventory, blocks: Sequence[BlockMeasure], pp_rank: int) -> tuple[int, int]:
    """``(forward FLOPs, recomputed FLOPs)`` of one micro-batch on the stages of ``pp_rank``."""
    forward = recompute = 0
    micro = inv.local_batch // inv.microbatches
    for stage in inv.stages_of(pp_rank):
        for i in inv.stage_layers[stage]:
            forward += blocks[i].flops
            if blocks[i].policy == "recompute":
                recompute += blocks[i].flops
        if stage == inv.n_stages - 1:
            forward += 2 * micro * inv.seq_len * inv.hidden * inv.vocab
    return forward, recompute


def wire_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """Bytes a rank sends for one collective of ``nbytes`` input over ``ranks`` (ring)."""
    if ranks <= 1 or kind == "recv":
        return 0.0
    share = (ranks - 1) / ranks
    factors = {
        "all_gather": ranks - 1,
        "reduce_scatter": share,
        "all_to_all": share,
        "all_reduce": 2 * share,
    }
    return nbytes * factors.get(kind, 1.0)


def group_span(inv: Inventory, dim: str, rank: int) -> tuple[int, int, int]:
    """``(ranks, lowest, highest)`` of ``rank``'s group along mesh dimension ``dim`` (a mesh
    dimension or a flattened one; ``world`` for all ranks, anything else for ``rank`` alone),
    from the row-major layout of the world mesh without listing its members."""
    dims = inv.dims
    if dim == "world":
        return dims.world_size, 0, dims.world_size - 1
    along = FLATTENED_DIMS.get(dim, (dim,))
    if not set(along) <= set(MESH_DIMS):
        return 1, rank, rank
    coords = mesh_coords(dims, rank)
    stride, low, high, count = 1, rank, rank, 1
    for name in reversed(MESH_DIMS):
        size = getattr(dims, name)
        if name in along:
            low -= coords[name] * stride
            high += (size - 1 - coords[name]) * stride
            count *= size
        stride *= size
    return count, low, high


def comm_seconds(
    inv: Inventory, collectives: Sequence[CollectiveBytes], rank: int, profile: DeviceProfile
) -> dict[str, float]:
    """Seconds of ``rank``'s collectives by source."""
    node = profile.ranks_per_node
    seconds: dict[str, float] = {}
    for c in collectives:
        ranks, low, high = group_span(inv, c.dim, rank)
        link = (
            profile.intra_node_bandwidth
            if low // node == high // node
            else (profile.inter_node_bandwidth)
        )
        wire = wire_bytes(c.kind, c.bytes, ranks)
        seconds[c.source] = seconds.get(c.source, 0.0) + wire / link.value
    return seconds


def estimate_step(
    inv: Inventory,
    blocks: Sequence[BlockMeasure],
    ns: NSWork,
    collectives: Sequence[CollectiveBytes],
    rank: int,
    profile: DeviceProfile,
    dtype: torch.dtype,
    efficiency: float | None = None,
) -> StepEstimate:
    """The step time of ``rank`` (see the module docstring for the model).

    Args:
        inv: the model and layout.
        blocks: each block measured for one micro-batch (:func:`measure_blocks`).
        ns: Newton-Schulz work of the layout (:func:`~hyperparallel.plan.muon_work.ns_work`).
        collectives: ``rank``'s collectives per step (:func:`predict_collectives`).
        rank: the rank estimated.
        profile: the device.
        dtype: the parameters' dtype (the compute rate).
        efficiency: fraction of the peak the compute reaches; default 1.0 for a measured
            profile, 0.5 for published figures.
    """
    if efficiency is None:
        efficiency = 1.0 if profile.fp32_flops.source.startswith("measured") else 0.5
    pp_rank = mesh_coords(inv.dims, rank)["pp"]
    forward, recompute = forward_flops(inv, blocks, pp_rank)
    flops = inv.microbatches * (3 * forward + recompute)
    compute = flops / (profile.flops(dtype) * efficiency)
    comm = comm_seconds(inv, collectives, rank, profile)
    overlapped = sum(t for source, t in comm.items() if source in OVERLAPPED)
    exposed = sum(t for source, t in comm.items() if source not in OVERLAPPED | {"muon"})
    pp = inv.dims.pp
    bubble = compute * (pp - 1) / inv.microbatches if pp > 1 else 0.0
    measured = profile.fp32_flops.source.startswith("measured")
    ns_rate = profile.flops(torch.float32 if measured else torch.bfloat16) * efficiency
    optimizer = max(ns.max_flops / ns_rate, comm.get("muon", 0.0))
    return StepEstimate(compute, overlapped, exposed, bubble, optimizer)
