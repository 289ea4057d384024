"""Bytes each collective of one training step moves on a rank, per mesh dimension.

Derived from the parameter inventory and the same rules the running code follows: FSDP2's
padded dim-0 shards (one all-gather per unit in forward, again in backward for every unit but the
root, one reduce-scatter per unit, HSDP's all-reduce of the shard over ``dp_replicate``), the
expert stacks' own gathers and gradient reductions over ``dp_shard`` / ``dp_replicate``, the
expert dispatch's all-to-alls, the pipeline's activation send/recv at every stage boundary
between two ranks under the job's stage placement (1F1B, interleaved, DualPipeV), and Muon's owner
plan (:func:`hyperparallel.optim.plan.build_plan`, the function every rank calls) for its packed
gather/scatter and replica sums. The byte definition is the one
:mod:`npu_core.dist.counting` measures: the tensors this rank passes in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from hyperparallel.optim.muon import DEFAULT_COMM_BATCH_BYTES
from hyperparallel.optim.plan import MatrixSpec, build_plan, shard_rows
from hyperparallel.parallel.mesh import ParallelDims
from hyperparallel.plan.inventory import Inventory, ParamEntry, mesh_coords
from hyperparallel.plan.measure import dim_name
from hyperparallel.train.config import TrainConfig

MUON_FP32 = 4
"""Muon moves and sums its updates in fp32 (the engine casts local rows with ``.float()``)."""
EXPERT_COUNT_BYTES = 8
"""Per-expert token counts are int64 (``torch.bincount``)."""
FLAG_BYTES = 4
"""Muon's per-parameter finiteness flags travel as int32."""
FORWARD_REPLAYED = frozenset({"recompute"})
"""Activation policies under which backward re-runs a whole block's forward, its expert
exchanges and expert gathers included (``selective`` saves collectives' outputs instead)."""


@dataclass(frozen=True)
class CollectiveBytes:
    """One kind of collective one source issues on one mesh dimension, per step, on one rank.

    Attributes:
        source: who issues it: ``fsdp``, ``hsdp``, ``expert_fsdp`` / ``expert_hsdp`` (the
            expert stacks' redistribution over ``dp_shard`` / ``dp_replicate``), ``ep``,
            ``pp``, ``muon``.
        kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``send``,
            ``recv``.
        dim: the process group's mesh dimension name (:func:`~hyperparallel.plan.measure.dim_name`).
        calls: calls per step on this rank.
        bytes: bytes per step this rank passes in to those calls.
        balanced: the bytes depend on routing (the expert dispatch's return trip carries what
            this rank received): ``bytes`` is this rank's even share, and the sum over the ep
            group is exact while a single rank's is not.
    """

    source: str
    kind: str
    dim: str
    calls: int
    bytes: int
    balanced: bool = False


def predict_collectives(
    cfg: TrainConfig, dims: ParallelDims, inventory: Inventory, rank: int
) -> list[CollectiveBytes]:
    """Every collective ``rank`` issues in one steady-state training step (forward, backward,
    optimizer step) under ``dims``."""
    pp_rank = mesh_coords(dims, rank)["pp"]
    held = inventory.params_of(pp_rank)
    out = [
        *_fsdp(dims, inventory, held),
        *_expert_fsdp(dims, inventory, pp_rank, held),
        *_expert_dispatch(cfg, dims, inventory, pp_rank, held),
        *_pipeline(dims, inventory, pp_rank, held),
        *_muon(cfg, dims, held, rank),
    ]
    return [c for c in out if c.calls]


def _fsdp(
    dims: ParallelDims, inventory: Inventory, held: tuple[ParamEntry, ...]
) -> list[CollectiveBytes]:
    shards = dims.ep * dims.dp_shard
    if shards == 1:  # FSDP2 issues nothing on a one-rank shard group
        return []
    units: dict[tuple[int, str], int] = defaultdict(int)
    for p in held:
        if not p.expert:
            rows = -(-p.shape[0] // shards) if p.shape else 1
            units[(p.stage, p.fsdp_unit)] += rows * math.prod(p.shape[1:]) * p.itemsize
    shard_bytes = sum(units.values())
    blocks = {key: b for key, b in units.items() if key[1]}
    roots = len(units) - len(blocks)
    # A block is resharded after each forward, so gathered once per micro-batch, and once more
    # for backward (the pipeline keeps it unsharded until its last micro-batch's backward); a
    # root stays gathered from its first forward to the end of backward.
    m = inventory.microbatches
    gather_calls = (m + 1) * len(blocks) + roots
    gather_bytes = m * sum(blocks.values()) + shard_bytes
    dim = dim_name(dims, "dp_shard_ep")
    out = [
        CollectiveBytes("fsdp", "all_gather", dim, gather_calls, gather_bytes),
        CollectiveBytes("fsdp", "reduce_scatter", dim, len(units), shards * shard_bytes),
    ]
    if dims.dp_replicate > 1:
        out.append(
            CollectiveBytes(
                "hsdp", "all_reduce", dim_name(dims, "dp_replicate"), len(units), shard_bytes
            )
        )
    return out


def _moe_layers(inventory: Inventory, pp_rank: int) -> list[int]:
    """The MoE blocks of the stages ``pp_rank`` holds."""
    stages = set(inventory.stages_of(pp_rank))
    return [
        i
        for s, block_range in enumerate(inventory.stage_layers)
        if s in stages
        for i in block_range
        if i in inventory.moe_layers
    ]


def _forward_runs(inventory: Inventory, layers: list[int]) -> int:
    """Forward passes of ``layers`` per micro-batch, summed: two for a block whose backward
    replays its forward (:data:`FORWARD_REPLAYED`), else one."""
    return sum(2 if inventory.block_policies[i] in FORWARD_REPLAYED else 1 for i in layers)


def _expert_fsdp(
    dims: ParallelDims, inventory: Inventory, pp_rank: int, held: tuple[ParamEntry, ...]
) -> list[CollectiveBytes]:
    """The expert stacks' own data parallelism (:meth:`ExpertParallelDispatch.local_experts`):
    stored ``Shard(0)`` over ``ep`` and ``dp_shard`` and replicated over ``dp_replicate``, each
    stack is redistributed to whole ``[E / ep]`` experts at every forward call (one
    ``dp_shard`` all-gather per stack, micro-batch and forward run, a replayed forward
    included); its gradient comes back ``Partial`` over ``dp_shard`` and ``dp_replicate``: one
    reduce-scatter of the gathered size per stack and micro-batch, and over ``dp_replicate``
    an all-reduce of the resulting shard. Every MoE block holds the same stacks."""
    stacks = [p for p in held if p.expert]
    if not stacks:
        return []
    layers = _moe_layers(inventory, pp_rank)
    per_layer = len(stacks) // len(layers)
    shard = sum(
        p.shape[0] // (dims.ep * dims.dp_shard) * math.prod(p.shape[1:]) * p.itemsize
        for p in stacks
    )
    layer_shard = shard // len(layers)
    m = inventory.microbatches
    runs = _forward_runs(inventory, layers)
    out = []
    if dims.dp_shard > 1:
        dim = dim_name(dims, "dp_shard")
        out += [
            CollectiveBytes(
                "expert_fsdp", "all_gather", dim, m * runs * per_layer, m * runs * layer_shard
            ),
            CollectiveBytes(
                "expert_fsdp", "reduce_scatter", dim, m * len(stacks), m * dims.dp_shard * shard
            ),
        ]
    if dims.dp_replicate > 1:
        out.append(
            CollectiveBytes(
                "expert_hsdp",
                "all_reduce",
                dim_name(dims, "dp_replicate"),
                m * len(stacks),
                m * shard,
            )
        )
    return out


def _expert_dispatch(
    cfg: TrainConfig,
    dims: ParallelDims,
    inventory: Inventory,
    pp_rank: int,
    held: tuple[ParamEntry, ...],
) -> list[CollectiveBytes]:
    if dims.ep == 1:
        return []
    layers = _moe_layers(inventory, pp_rank)
    runs = _forward_runs(inventory, layers)
    itemsize = next(p.itemsize for p in held if p.expert)
    tokens = inventory.local_batch * inventory.seq_len
    chunks = cfg.parallel.ep_chunks
    m = inventory.microbatches
    # Per MoE layer and micro-batch, each forward run (a replayed one too) sends the counts,
    # then per chunk the tokens out and back; backward sends them out and back once more.
    # Outbound rows are this rank's T x k routed copies; the return trips carry what it
    # received, T x k on average over the ep group.
    trip = tokens * inventory.top_k * inventory.hidden * itemsize
    counts = inventory.n_experts * EXPERT_COUNT_BYTES * m
    forward_calls, backward_calls = (1 + 2 * chunks) * m, 2 * chunks * m
    return [
        CollectiveBytes(
            "ep",
            "all_to_all",
            dim_name(dims, "ep"),
            forward_calls * runs + backward_calls * len(layers),
            (2 * trip + counts) * runs + 2 * trip * len(layers),
            balanced=True,
        )
    ]


def _pipeline(
    dims: ParallelDims, inventory: Inventory, pp_rank: int, held: tuple[ParamEntry, ...]
) -> list[CollectiveBytes]:
    """Per micro-batch, every stage boundary between two pipeline ranks carries the activation
    forward and its gradient back; a boundary between two stages on the same rank (the V
    schedules' turn) is passed in memory. Stage placement is the job's (``Inventory.holder``)."""
    if dims.pp == 1:
        return []
    micro = inventory.local_batch // inventory.microbatches
    itemsize = max(p.itemsize for p in held)
    act = micro * inventory.seq_len * inventory.hidden * itemsize
    m = inventory.microbatches
    crossings = 0
    for stage in inventory.stages_of(pp_rank):
        for neighbour in (stage - 1, stage + 1):
            if 0 <= neighbour < inventory.n_stages and inventory.holder(neighbour) != pp_rank:
                crossings += 1
    dim = dim_name(dims, "pp")
    return [
        CollectiveBytes("pp", "send", dim, crossings * m, crossings * m * act),
        CollectiveBytes("pp", "recv", dim, crossings * m, crossings * m * act),
    ]


def _muon(
    cfg: TrainConfig, dims: ParallelDims, held: tuple[ParamEntry, ...], rank: int
) -> list[CollectiveBytes]:
    muon = [p for p in held if p.optimizer == "muon"]
    if not muon:
        return []
    coords = mesh_coords(dims, rank)
    out = []
    # finiteness flags: one MIN all-reduce per dimension of the first update's mesh
    first_mesh = _experts_mesh(dims) if muon[0].expert else _dense_mesh(dims)
    for dim in first_mesh:
        flags = FLAG_BYTES * len(muon)
        out.append(CollectiveBytes("muon", "all_reduce", dim_name(dims, dim), 1, flags))
    shards = dims.ep * dims.dp_shard
    replicas = dims.dp_replicate
    shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
    replica = coords["dp_replicate"]
    rows = {
        i: (p.shape[0], math.prod(p.shape[1:])) for i, p in enumerate(muon) if not p.expert_stack
    }
    if rows:
        specs = [MatrixSpec(i, r, c) for i, (r, c) in rows.items()]
        plan = build_plan(specs, shards, replicas, DEFAULT_COMM_BATCH_BYTES)
        shard_dim = dim_name(dims, "dp_shard_ep")
        sent = 0
        for batch in plan.batches:
            mine = [a for a in batch if a.replica == replica]
            sent += sum(
                shard_rows(rows[a.index][0], shards)[shard_rank] * rows[a.index][1] for a in mine
            )
            sent += sum(math.prod(rows[a.index]) for a in mine if a.owner == shard_rank)
        out.append(
            CollectiveBytes(
                "muon", "all_to_all", shard_dim, 2 * len(plan.batches), MUON_FP32 * sent
            )
        )
        if replicas > 1:
            shared = sum(
                shard_rows(rows[a.index][0], shards)[shard_rank] * rows[a.index][1]
                for batch in plan.batches
                for a in batch
            )
            out.append(
                CollectiveBytes(
                    "muon",
                    "all_reduce",
                    dim_name(dims, "dp_replicate"),
                    len(plan.batches),
                    MUON_FP32 * shared,
                )
            )
    if replicas > 1:
        local = sum(
            shard_rows(p.shape[0], shards)[shard_rank] * math.prod(p.shape[1:])
            for p in muon
            if p.expert_stack
        )
        if local:
            out.append(
                CollectiveBytes(
                    "muon", "all_reduce", dim_name(dims, "dp_replicate"), 1, MUON_FP32 * local
                )
            )
    return out


def _dense_mesh(dims: ParallelDims) -> tuple[str, ...]:
    return ("dp_replicate", "dp_shard_ep") if dims.dp_replicate > 1 else ("dp_shard_ep",)


def _experts_mesh(dims: ParallelDims) -> tuple[str, ...]:
    return tuple(d for d in ("dp_replicate", "ep", "dp_shard") if d == "ep" or getattr(dims, d) > 1)
