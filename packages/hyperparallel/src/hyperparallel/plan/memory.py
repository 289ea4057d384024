"""Per-rank memory of a training step: parameters, gradients, optimizer state, saved activations,
and the unsharded weights FSDP2 and expert parallelism hold for a moment.

Shards follow the job's placements: dense weights ``Shard(0)`` over ``ep x dp_shard`` (torch.chunk
rows, replicated over ``dp_replicate``), expert stacks ``E / (ep x dp_shard)`` whole experts on the
expert mesh, each pipeline rank only its stages. Bytes are those of the local shards, as
``DTensor.to_local()`` holds them (FSDP2 pads its flat storage to the largest shard, at most one
row per parameter more). Optimizer state is Muon's momentum (one copy of the gradient) and
AdamW's two moments; their scalar step counters are left out.

Saved activations come from :mod:`~hyperparallel.plan.activations` (each block measured on the
meta device under its policy), plus what the model saves outside its blocks (embedding, final
norm, head and loss), measured the same way with the blocks taken out. Assumptions, stated where
they are made: without pp one forward holds the whole local batch; under pp each stage holds
``min(microbatches, pp - pp_rank)`` micro-batches at once under 1F1B and ``min(microbatches, pp)``
under the interleaved and V schedules (an upper estimate for interleaved's later stages). FSDP2
holds the root unit unsharded through the step and two block units at once (the current one and
the prefetched one) plus one unit's unsharded gradients; Muon holds a communication batch of whole
fp32 matrices twice (gathered and orthogonalised) during the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hyperparallel.models.hf import CausalLM
from hyperparallel.models.lm_loss import chunked_linear_cross_entropy
from hyperparallel.optim.muon import DEFAULT_COMM_BATCH_BYTES
from hyperparallel.optim.plan import shard_rows
from hyperparallel.parallel.pipeline import lm_loss
from hyperparallel.plan.activations import (
    ActivationBytes,
    BlockMeasure,
    block_activations,
    measure_blocks,
    run_model,
)
from hyperparallel.plan.inventory import (
    Inventory,
    MetaModel,
    ParamEntry,
    make_stage,
    mesh_coords,
)
from hyperparallel.train.config import ActivationConfig


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds in a training step.

    Attributes:
        rank: global rank.
        params: parameter shards.
        grads: gradient shards.
        optimizer: optimizer state (Muon momentum, AdamW moments).
        activations: saved activations of the whole step (every micro-batch), by placement.
        activations_peak: saved activations waiting at once (micro-batches in flight), by
            placement.
        transient: unsharded weights and gradients held for a moment (FSDP2 units, gathered
            experts) or Muon's communication batches, whichever is larger.
    """

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: ActivationBytes
    activations_peak: ActivationBytes
    transient: int

    @property
    def peak(self) -> int:
        """Device bytes at the step's peak: the persistent state, the activations on the device
        at once, and the transient buffers."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations_peak.device
            + self.transient
        )


def local_bytes(inv: Inventory, entry: ParamEntry, shard_rank: int) -> int:
    """Bytes of ``entry`` stored on the rank at ``shard_rank`` of the dense shard group."""
    dims = inv.dims
    if not entry.shape or not entry.shape[0]:
        return entry.nbytes
    row = entry.nbytes // entry.shape[0]
    if entry.expert:
        return entry.shape[0] // (dims.ep * dims.dp_shard) * row
    return shard_rows(entry.shape[0], dims.ep * dims.dp_shard)[shard_rank] * row


def optimizer_bytes(entry: ParamEntry, local: int) -> int:
    """Muon keeps one momentum buffer, AdamW two moments, each shaped like the local shard."""
    return local * (1 if entry.optimizer == "muon" else 2)


def rank_memory(
    meta: MetaModel,
    inv: Inventory,
    act: ActivationConfig,
    rank: int,
    batch_bytes: int = DEFAULT_COMM_BATCH_BYTES,
) -> RankMemory:
    """Memory of ``rank`` under ``inv``'s layout (see the module docstring)."""
    dims = inv.dims
    coords = mesh_coords(dims, rank)
    shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
    held = inv.params_of(coords["pp"])
    local = [local_bytes(inv, p, shard_rank) for p in held]
    optimizer = sum(optimizer_bytes(p, n) for p, n in zip(held, local, strict=True))
    per_step, peak = _activations(meta, inv, act, coords["pp"])
    transient = max(_fsdp_transient(inv, held), 2 * _muon_batch(held, batch_bytes))
    return RankMemory(rank, sum(local), sum(local), optimizer, per_step, peak, transient)


def memory_by_rank(
    meta: MetaModel,
    inv: Inventory,
    act: ActivationConfig,
    batch_bytes: int = DEFAULT_COMM_BATCH_BYTES,
    blocks: tuple[BlockMeasure, ...] | None = None,
) -> tuple[RankMemory, ...]:
    """:func:`rank_memory` of every rank: the blocks measured once (or ``blocks``, from
    :func:`~hyperparallel.plan.activations.measure_blocks` for a micro-batch) and shard sizes
    summed per shard rank in one pass (16,384 ranks in well under a second)."""
    dims = inv.dims
    shards = dims.ep * dims.dp_shard
    blocks = blocks or measure_blocks(meta, inv, inv.local_batch // inv.microbatches)
    per_pp = []
    for pp_rank in range(dims.pp):
        held = inv.params_of(pp_rank)
        params = _bytes_by_shard(inv, held, shards, state=False)
        state = _bytes_by_shard(inv, held, shards, state=True)
        per_step, peak = _activations(meta, inv, act, pp_rank, blocks)
        transient = max(_fsdp_transient(inv, held), 2 * _muon_batch(held, batch_bytes))
        per_pp.append((params, state, per_step, peak, transient))
    result = []
    for rank in range(dims.world_size):
        coords = mesh_coords(dims, rank)
        shard_rank = coords["ep"] * dims.dp_shard + coords["dp_shard"]
        params, state, per_step, peak, transient = per_pp[coords["pp"]]
        local = params[shard_rank]
        result.append(RankMemory(rank, local, local, state[shard_rank], per_step, peak, transient))
    return tuple(result)


def _bytes_by_shard(
    inv: Inventory, held: tuple[ParamEntry, ...], shards: int, *, state: bool
) -> list[int]:
    """Local bytes (or optimizer-state bytes) of ``held`` summed per shard rank: each dense
    parameter gives ``chunk`` rows to its first full ranks, the rest to one rank, none after."""
    delta = [0] * (shards + 1)
    for p in held:
        times = (1 if p.optimizer == "muon" else 2) if state else 1
        if p.expert or not p.shape:
            nbytes = local_bytes(inv, p, 0) * times
            delta[0] += nbytes
            delta[shards] -= nbytes
            continue
        rows = p.shape[0]
        row = p.nbytes // rows * times
        chunk = -(-rows // shards)
        full = rows // chunk
        delta[0] += chunk * row
        delta[full] -= chunk * row
        if full < shards and rows % chunk:
            delta[full] += rows % chunk * row
            delta[full + 1] -= rows % chunk * row
    totals, running = [], 0
    for change in delta[:shards]:
        running += change
        totals.append(running)
    return totals


def _fsdp_transient(inv: Inventory, held: tuple[ParamEntry, ...]) -> int:
    """The root unit unsharded, two block units unsharded and one unit's gradients."""
    dims = inv.dims
    units: dict[str, int] = {}
    for p in held:
        if p.expert:  # gathered over dp_shard for the forward: this ep rank's experts
            gathered = p.nbytes // dims.ep if dims.dp_shard > 1 else 0
            units[p.fsdp_unit] = units.get(p.fsdp_unit, 0) + gathered
        else:
            units[p.fsdp_unit] = units.get(p.fsdp_unit, 0) + p.nbytes
    root = units.pop("", 0)
    largest = max(units.values(), default=0)
    return root + 3 * largest


def _muon_batch(held: tuple[ParamEntry, ...], batch_bytes: int) -> int:
    """An owner's largest communication batch of whole fp32 matrices: the batch budget (or the
    largest matrix, which gets a batch of its own), at most every dense Muon matrix held."""
    sizes = [p.numel * 4 for p in held if p.optimizer == "muon" and not p.expert_stack]
    if not sizes:
        return 0
    return min(max(batch_bytes, max(sizes)), sum(sizes))


def _in_flight(inv: Inventory, pp_rank: int) -> int:
    """Micro-batches whose activations a stage of ``pp_rank`` holds at once."""
    pp, m = inv.dims.pp, inv.microbatches
    if pp == 1:
        return 1
    return min(m, pp - pp_rank) if inv.schedule == "1f1b" else min(m, pp)


def _activations(
    meta: MetaModel,
    inv: Inventory,
    act: ActivationConfig,
    pp_rank: int,
    measured: tuple[BlockMeasure, ...] | None = None,
) -> tuple[ActivationBytes, ActivationBytes]:
    """``(whole step, at the peak)`` of the stages ``pp_rank`` holds."""
    micro = inv.local_batch // inv.microbatches
    blocks = block_activations(meta, inv, act, micro, measured)
    per_micro = ActivationBytes()
    for stage in inv.stages_of(pp_rank):
        for i in inv.stage_layers[stage]:
            per_micro = per_micro + blocks[i]
        per_micro = per_micro + rest_activations(meta, inv, stage, micro)
    return per_micro * inv.microbatches, per_micro * _in_flight(inv, pp_rank)


def rest_activations(meta: MetaModel, inv: Inventory, stage: int, micro: int) -> ActivationBytes:
    """What ``stage`` saves outside its blocks for one micro-batch: the embedding on the first
    stage, the final norm, head and loss on the last (the whole model's loss without pp: the
    built-in MoE's logits and cross-entropy, a transformers model's chunked cross-entropy)."""
    first, last = stage == 0, stage == inv.n_stages - 1
    if not (first or last):
        return ActivationBytes()
    with torch.device("meta"):
        tokens = torch.zeros(micro, inv.seq_len, dtype=torch.long)
        dtype = next(meta.module.parameters()).dtype
        hidden = torch.empty(micro, inv.seq_len, inv.hidden, dtype=dtype).requires_grad_()
    if inv.n_stages == 1:
        with _without_blocks(meta.module):
            return run_model(lambda: _whole_loss(meta.module, tokens))
    module = make_stage(meta, range(0), first, last)

    def forward() -> object:
        out = module(tokens if first else hidden.clone())
        return lm_loss(out, tokens) if last else out

    return run_model(forward)


def _whole_loss(module: nn.Module, tokens: torch.Tensor) -> object:
    """The job's loss of the whole model without pp, less the balance loss (which reads the
    blocks' router logits, and saves a few bytes per block): the built-in MoE's logits and
    cross-entropy, or a transformers decoder's chunked cross-entropy as :class:`CausalLM` runs
    it."""
    if not isinstance(module, CausalLM):
        logits, _ = module(tokens)
        return lm_loss(logits, tokens)
    out = module.decoder(input_ids=tokens, use_cache=False)
    head = module.model.get_output_embeddings()
    return chunked_linear_cross_entropy(
        out.last_hidden_state,
        head.weight,
        tokens,
        head.bias,
        chunk_rows=module.chunk_rows,
        softcap=getattr(module.model.config, "final_logit_softcapping", None),
    )


@contextmanager
def _without_blocks(module: nn.Module) -> Iterator[None]:
    """``module`` with an empty list of decoder blocks for the duration."""
    if isinstance(module, CausalLM):
        parent_path, _, name = f"model.{module.plan.layers}".rpartition(".")
        parent = module.get_submodule(parent_path)
    else:
        parent, name = module, "layers"
    blocks = getattr(parent, name)
    setattr(parent, name, nn.ModuleList())
    try:
        yield
    finally:
        setattr(parent, name, blocks)
