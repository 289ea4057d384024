"""One plan: the job's model and layout at a world size, turned into per-rank memory,
collectives, Newton-Schulz work and a step-time estimate (each by its own module)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyperparallel.parallel.mesh import ParallelDims
from hyperparallel.plan.activations import BlockMeasure, measure_blocks
from hyperparallel.plan.collectives import CollectiveBytes, predict_collectives
from hyperparallel.plan.estimate import StepEstimate, estimate_step
from hyperparallel.plan.inventory import (
    Inventory,
    MetaModel,
    build_meta_model,
    mesh_coords,
    model_inventory,
)
from hyperparallel.plan.memory import RankMemory, memory_by_rank
from hyperparallel.plan.muon_work import SCHEMES, NSWork, ns_work
from hyperparallel.plan.profiles import DeviceProfile
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.registry import model_spec


@dataclass(frozen=True)
class Plan:
    """Everything the planner predicts for one configuration and layout.

    Attributes:
        cfg: the train job's configuration.
        inventory: the model's parameters and the run's facts.
        blocks: each block measured on the meta device for one micro-batch.
        memory: per rank, every rank.
        ns: Newton-Schulz work per rank under each scheme of :data:`~.muon_work.SCHEMES`.
        collectives: per step, for each representative rank (:attr:`ranks`).
        estimates: step time of each representative rank, when a profile was given.
        profile: the device profile of the estimate, or None.
    """

    cfg: TrainConfig
    inventory: Inventory
    blocks: tuple[BlockMeasure, ...]
    memory: tuple[RankMemory, ...]
    ns: dict[str, NSWork]
    collectives: dict[int, list[CollectiveBytes]]
    estimates: dict[int, StepEstimate]
    profile: DeviceProfile | None

    @property
    def ranks(self) -> list[int]:
        """The representative ranks: the one with the highest peak memory on each pipeline
        rank (ranks of one pipeline rank differ only by uneven shards and NS owners)."""
        return sorted(self.collectives)

    @property
    def worst(self) -> RankMemory:
        """The rank with the highest peak memory."""
        return max(self.memory, key=lambda m: (m.peak, -m.rank))

    @property
    def step_seconds(self) -> float | None:
        """The slowest representative rank's step estimate (the step waits for it)."""
        return max((e.total for e in self.estimates.values()), default=None)


def make_plan(
    cfg: TrainConfig,
    dims: ParallelDims,
    profile: DeviceProfile | None = None,
    efficiency: float | None = None,
    *,
    module: nn.Module | None = None,
    measured: dict[int, tuple[BlockMeasure, ...]] | None = None,
) -> Plan:
    """Plan ``cfg`` on ``dims``: refused first as the job refuses it, then built on the meta
    device and measured once. A search passes the meta ``module`` it built for ``cfg`` and a
    ``measured`` cache (micro-batch size -> blocks) to share them between layouts.

    Raises:
        ValueError, FileNotFoundError: a configuration or layout the job refuses.
    """
    if module is None:
        meta = build_meta_model(cfg, dims)
    else:
        spec = model_spec(cfg)
        meta = MetaModel(spec, module, spec.check_layout(dims))
    inv = model_inventory(cfg, dims, meta)
    micro = inv.local_batch // inv.microbatches
    measured = {} if measured is None else measured
    if micro not in measured:
        measured[micro] = measure_blocks(meta, inv, micro)
    blocks = measured[micro]
    memory = memory_by_rank(meta, inv, cfg.activation, blocks=blocks)
    ns = {scheme: ns_work(inv, scheme) for scheme in SCHEMES}
    representatives: dict[int, RankMemory] = {}
    for m in memory:
        pp = mesh_coords(dims, m.rank)["pp"]
        if pp not in representatives or m.peak > representatives[pp].peak:
            representatives[pp] = m
    collectives: dict[int, list[CollectiveBytes]] = {
        m.rank: predict_collectives(cfg, dims, inv, m.rank) for m in representatives.values()
    }
    dtype = next(meta.module.parameters()).dtype
    estimates = {}
    if profile is not None:
        for rank, found in collectives.items():
            estimates[rank] = estimate_step(
                inv, blocks, ns["hyperparallel"], found, rank, profile, dtype, efficiency
            )
    return Plan(cfg, inv, blocks, memory, ns, collectives, estimates, profile)


def param_dtype(plan: Plan) -> torch.dtype:
    """The dtype the job trains the parameters in (all share one)."""
    sizes = {p.itemsize for p in plan.inventory.params}
    return torch.float32 if sizes == {4} else torch.bfloat16
