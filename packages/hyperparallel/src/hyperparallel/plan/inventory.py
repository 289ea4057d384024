"""Every parameter of the model a train job builds, as the planner needs it: name, global shape,
optimizer, expert placement, pipeline stage and FSDP unit.

The model is built on the meta device (real shapes, no memory) by the job's own model spec, its
optimizer routing is the job's (:func:`~hyperparallel.optim.hybrid.route_parameters` with the
spec's classifier), and pipeline stages are cut by the job's own stage modules over
:func:`~hyperparallel.parallel.pipeline.split_layers`. What each rank then stores, moves and
orthogonalises is left to the other planner modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyperparallel.models.hf import CausalLM
from hyperparallel.models.moe import MoEFeedForward, MoETransformer
from hyperparallel.models.parallelize import blocks
from hyperparallel.optim.hybrid import route_parameters
from hyperparallel.parallel.expert import EXPERT_WEIGHTS
from hyperparallel.parallel.hf_expert import expert_modules
from hyperparallel.parallel.hf_pipeline import DecoderStage
from hyperparallel.parallel.mesh import MESH_DIMS, ParallelDims
from hyperparallel.parallel.pipeline import StageModule, split_layers, stage_holder, stage_ids
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.hf_model import TransformersSpec, expert_count
from hyperparallel.train.model_spec import ModelSpec
from hyperparallel.train.registry import model_spec

BUILT_IN_MODEL = "built-in MoE"
""":attr:`Inventory.model` of the built-in MoE (a transformers model: its architecture name)."""


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of the model the job builds.

    Attributes:
        name: fully-qualified name in the model the job builds (``layers.3.attn.qkv.weight``,
            ``model.model.layers.3.mlp.experts.down_proj``).
        shape: global (unsharded) shape.
        itemsize: bytes per element of the parameter.
        optimizer: ``"muon"`` or ``"adamw"``, the job's own routing.
        expert: an expert stack placed on the ep mesh (dim 0 = experts); only under ``ep > 1``.
        stage: the pipeline stage that holds it (0 without pp).
        fsdp_unit: name of the module ``fully_shard`` was applied to that owns it (a decoder
            block; ``""`` for the root: the model, or under pp the stage module).
        expert_stack: a routed-expert stack ``[E, ...]`` whatever the mesh (without ep FSDP
            shards it on E with the dense weights).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    optimizer: str
    expert: bool
    stage: int
    fsdp_unit: str
    expert_stack: bool = False

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Inventory:
    """The model's parameters and the facts about the run that the other planner modules need.

    Attributes:
        params: every parameter, in the model's ``named_parameters`` order (the optimizer's).
        dims: the mesh layout.
        model: what is trained, for reports (``built-in MoE`` or the transformers class).
        n_layers: decoder blocks.
        hidden: hidden size.
        vocab: vocabulary size.
        n_experts: routed experts per MoE block (0 for a dense model).
        top_k: experts each token is routed to (0 for a dense model).
        moe_layers: indices of the blocks that hold routed experts.
        seq_len: tokens per sample.
        local_batch: samples per data-parallel rank per step.
        microbatches: micro-batches per step (1 without pp).
        schedule: the pipeline schedule name (meaningful under pp).
        stage_layers: blocks of each pipeline stage (one range covering all without pp).
        block_policies: activation policy of each block.
    """

    params: tuple[ParamEntry, ...]
    dims: ParallelDims
    model: str
    n_layers: int
    hidden: int
    vocab: int
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    seq_len: int
    local_batch: int
    microbatches: int
    schedule: str
    stage_layers: tuple[range, ...]
    block_policies: tuple[str, ...]

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def stages_of(self, pp_rank: int) -> list[int]:
        """Global stage indices held by pipeline rank ``pp_rank`` (the job's placement)."""
        if self.dims.pp == 1:
            return [0]
        per_rank = self.n_stages // self.dims.pp
        return stage_ids(self.schedule, self.dims.pp, pp_rank, per_rank)

    def holder(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return 0 if self.dims.pp == 1 else stage_holder(self.schedule, self.dims.pp, stage)

    def params_of(self, pp_rank: int) -> tuple[ParamEntry, ...]:
        """The parameters pipeline rank ``pp_rank`` holds, in the optimizer's order: the whole
        model's order restricted to its stages (its stage view lists blocks in stage order,
        which is model order, and the rest are AdamW's, whose order no plan depends on)."""
        held = set(self.stages_of(pp_rank))
        return tuple(p for p in self.params if p.stage in held)


def mesh_coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Rank ``rank``'s coordinate on each named mesh dimension (the world mesh is row-major
    over :data:`~hyperparallel.parallel.mesh.MESH_DIMS`, as ``init_device_mesh`` lays it out).

    Raises:
        ValueError: a rank outside the world.
    """
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside the {dims.world_size} ranks of {dims.spec()}")
    coords: dict[str, int] = {}
    for name in reversed(MESH_DIMS):
        size = getattr(dims, name)
        rank, coords[name] = divmod(rank, size)
    return {name: coords[name] for name in MESH_DIMS}


@dataclass(frozen=True)
class MetaModel:
    """The job's model built on the meta device, with its spec and the checked layout.

    Attributes:
        spec: the job's model spec for the configuration.
        module: the whole model (meta tensors: real shapes, no storage).
        local_batch: samples per data-parallel rank per step (from the job's layout check).
    """

    spec: ModelSpec
    module: nn.Module
    local_batch: int


def build_meta_model(cfg: TrainConfig, dims: ParallelDims) -> MetaModel:
    """Check ``dims`` as the job does, then build its model on the meta device.

    The layout is checked first, by the job's own checks (the same one-line refusals as
    ``hyperparallel train``); no weights are read (``hf.load_weights`` is ignored).

    Raises:
        ValueError, FileNotFoundError: a configuration or layout the job refuses.
    """
    hf = cfg.hf.model_copy(update={"load_weights": False})
    spec = model_spec(cfg.model_copy(update={"hf": hf}))
    local_batch = spec.check_layout(dims)
    with torch.device("meta"):
        module = spec.build_module(torch.device("meta"))
    return MetaModel(spec, module, local_batch)


def make_stage(meta: MetaModel, layers: range, first: bool, last: bool) -> nn.Module:
    """The job's pipeline stage module over blocks ``layers`` (without the balance loss)."""
    if isinstance(meta.spec, TransformersSpec):
        assert isinstance(meta.module, CausalLM)
        return DecoderStage(meta.module, layers, first, last, 0.0)
    assert isinstance(meta.module, MoETransformer)
    return StageModule(meta.module, layers, first, last, 0.0)


def model_inventory(
    cfg: TrainConfig, dims: ParallelDims, meta: MetaModel | None = None
) -> Inventory:
    """List the parameters of the job's model (:func:`build_meta_model`, or ``meta`` when it
    was built already for ``cfg`` and ``dims``) under ``dims``.

    Raises:
        ValueError, FileNotFoundError: a configuration or layout the job refuses.
    """
    meta = meta or build_meta_model(cfg, dims)
    spec, module, local_batch = meta.spec, meta.module, meta.local_batch
    n_stages = spec.pipeline_stages(dims) if dims.pp > 1 else 1
    ranges = tuple(split_layers(spec.n_layers, n_stages))
    stage_of = _stage_of_params(meta, ranges)
    unit_of = _fsdp_units(module)
    stacks = _expert_stacks(spec, module)
    routing = route_parameters(module, spec.classify(module))
    entries = []
    for name, param in module.named_parameters():
        entries.append(
            ParamEntry(
                name=name,
                shape=tuple(param.shape),
                itemsize=param.element_size(),
                optimizer=routing[name],
                expert=dims.ep > 1 and id(param) in stacks,
                stage=stage_of.get(id(param), 0),
                fsdp_unit=_unit(name, unit_of),
                expert_stack=id(param) in stacks,
            )
        )
    hidden, vocab, n_experts, top_k, model_name = _shape_facts(spec)
    blocks_with_experts = tuple(
        i
        for i, block in enumerate(blocks(module))
        if any(id(p) in stacks for p in block.parameters())
    )
    return Inventory(
        params=tuple(entries),
        dims=dims,
        model=model_name,
        n_layers=spec.n_layers,
        hidden=hidden,
        vocab=vocab,
        n_experts=n_experts,
        top_k=top_k,
        moe_layers=blocks_with_experts,
        seq_len=cfg.data.seq_len,
        local_batch=local_batch,
        microbatches=cfg.parallel.microbatches if dims.pp > 1 else 1,
        schedule=cfg.parallel.pp_schedule,
        stage_layers=ranges,
        block_policies=tuple(spec.block_policies()),
    )


def _stage_of_params(meta: MetaModel, ranges: tuple[range, ...]) -> dict[int, int]:
    """``id(param) -> stage`` from the job's own stage modules (a single stage without pp)."""
    if len(ranges) == 1:
        return {}
    last = len(ranges) - 1
    stage_of: dict[int, int] = {}
    for index, layers in enumerate(ranges):
        stage = make_stage(meta, layers, index == 0, index == last)
        for param in stage.parameters():
            stage_of.setdefault(id(param), index)
    return stage_of


def _fsdp_units(module: nn.Module) -> dict[str, str]:
    """Block name prefix (``layers.3.``) -> block name: the job's FSDP units below the root."""
    ids = {id(block) for block in blocks(module)}
    return {f"{name}.": name for name, sub in module.named_modules() if id(sub) in ids}


def _unit(name: str, units: dict[str, str]) -> str:
    prefix = name
    while "." in prefix:
        prefix = prefix.rpartition(".")[0]
        if f"{prefix}." in units:
            return units[f"{prefix}."]
    return ""


def _expert_stacks(spec: ModelSpec, module: nn.Module) -> set[int]:
    """``id`` of every routed-expert stack: what expert parallelism places on the ep mesh."""
    if isinstance(spec, TransformersSpec):
        found = expert_modules(module.get_submodule("model"), spec.model.plan)
        return {id(p) for _, owner in found for p in owner.parameters(recurse=False)}
    return {
        id(getattr(sub, weight))
        for sub in module.modules()
        if isinstance(sub, MoEFeedForward)
        for weight in EXPERT_WEIGHTS
    }


def _shape_facts(spec: ModelSpec) -> tuple[int, int, int, int, str]:
    """``(hidden, vocab, experts, top_k, model name)`` from the spec's configuration."""
    if isinstance(spec, TransformersSpec):
        config = spec.model.config
        count = expert_count(config)
        top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if count else 0
        return (
            int(config.hidden_size),
            int(config.vocab_size),
            count[1] if count else 0,
            top_k,
            spec.model.architecture,
        )
    m = spec.cfg.model
    return m.dim, m.vocab_size, m.n_experts, m.top_k, BUILT_IN_MODEL
