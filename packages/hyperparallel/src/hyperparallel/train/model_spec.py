"""What the train job needs from a model, as one interface (torchtitan's ModelSpec / TrainSpec).

The job picks a spec once (:func:`hyperparallel.train.registry.model_spec`) and asks it for
everything model-specific: the configuration's checks against a mesh layout, the training
windows (with the model's tokenizer), the model itself and its parallelize plan (FSDP units,
expert placement, pipeline support). The built-in MoE (:mod:`hyperparallel.train.model`) and the
transformers families (:mod:`hyperparallel.train.hf_model`) implement it. The recipe both share
lives here: one activation policy per block, experts placed before FSDP (and left out of it),
one FSDP2 unit per block then the root, and the checks every layout needs whatever the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hyperparallel.data.stdlib_bytes import ByteBatches
from hyperparallel.models.parallelize import apply_activation_memory, apply_fsdp
from hyperparallel.optim.hybrid import Classifier
from hyperparallel.parallel.expert import ExpertDispatchConfig
from hyperparallel.parallel.mesh import MeshSet, ParallelDims
from hyperparallel.parallel.pipeline import split_layers, stages_per_rank
from hyperparallel.train.config import PARAMETER_DTYPES, TrainConfig
from hyperparallel.train.parallel_model import ParallelModel

Losses = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""``(inputs, targets) -> (mean cross-entropy, balance loss)`` of a whole (unpipelined) model."""


class ModelSpec(ABC):
    """One kind of model the train job can train, configured by ``cfg``.

    Subclasses state the model's facts (blocks, experts, data, losses); :meth:`check_layout` and
    :meth:`build` turn them into the checked, parallelized model the trainer runs. A spec reads
    and checks its model's own configuration when it is made, so making one is the first check.

    Attributes:
        cfg: the whole training configuration.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (``dtype``): what :meth:`build_module` builds them in."""
        return PARAMETER_DTYPES[self.cfg.dtype]

    @property
    @abstractmethod
    def n_layers(self) -> int:
        """Decoder blocks: the FSDP units and activation regions, what pipelines split."""

    @abstractmethod
    def check_model_layout(self, dims: ParallelDims) -> None:
        """Refuse a layout the model cannot take (a pipeline, for a model that is not cut into
        stages; experts that do not divide over ``ep x dp_shard``), naming the setting and the
        mesh dimension. Every pipeline needs a block per stage: :meth:`check_layout` checks it.

        Raises:
            ValueError: the first such conflict.
        """

    @abstractmethod
    def batches(self) -> ByteBatches:
        """The training and validation windows of ``data.path`` in the model's token ids, drawn
        per (seed, sample, step), so ``--resume`` is exact.

        Raises:
            ValueError, FileNotFoundError: a missing, empty or binary source.
        """

    @abstractmethod
    def build_module(self, device: torch.device) -> nn.Module:
        """The whole model with its initial weights (the same on every rank) on ``device``;
        its ``layers`` are the decoder blocks."""

    @abstractmethod
    def place_experts(self, module: nn.Module, meshes: MeshSet) -> list[nn.Parameter]:
        """Under ep, place the routed experts of ``module`` (the model or a pipeline stage) on
        ``meshes.experts`` and route their tokens by all-to-all; the placed parameters, which
        FSDP leaves alone.

        Raises:
            ValueError: experts that do not divide over ``ep x dp_shard``, or none to place.
        """

    @abstractmethod
    def losses(self, module: nn.Module) -> Losses:
        """The loss of the whole model built by :meth:`build_module`."""

    def check_weights(self) -> None:
        """Refuse initial weights the model cannot load, before any rank reads them (the
        default: the weights are made, not loaded, so there is nothing to check).

        Raises:
            ValueError, FileNotFoundError: one line naming the files and what does not fit.
        """
        return None

    def parameter_count(self) -> tuple[int, str] | None:
        """``(parameters, the model and its size settings, for a message)`` without building
        the model, for the memory check before ranks start; None where counting costs more
        than the check saves (the default: a model would have to be built, which takes seconds
        even on the meta device)."""
        return None

    def expert_dispatch(self) -> ExpertDispatchConfig:
        """How expert-parallel dispatch overlaps its all-to-alls (``parallel.ep_chunks``,
        ``parallel.ep_local_first``)."""
        parallel = self.cfg.parallel
        return ExpertDispatchConfig(chunks=parallel.ep_chunks, local_first=parallel.ep_local_first)

    def classify(self, module: nn.Module) -> Classifier | None:
        """The optimizer's Muon / AdamW routing for ``module``; None: its default by shape."""
        return None

    def pipeline_stages(self, dims: ParallelDims) -> int:
        """Pipeline stages in all under ``dims`` and the configured schedule."""
        par = self.cfg.parallel
        return dims.pp * stages_per_rank(par.pp_schedule, par.virtual_stages)

    def check_layout(self, dims: ParallelDims) -> int:
        """Everything about the configuration that depends on the mesh, before any rank starts;
        returns the local batch size (samples per data-parallel rank per step).

        Raises:
            ValueError: naming the setting and the mesh dimension it conflicts with.
        """
        cfg, par = self.cfg, self.cfg.parallel
        local = dims.local_batch_size(
            cfg.data.batch_size, cfg.data.global_batch_size, par.microbatches
        )
        self.check_model_layout(dims)
        if par.pp_early_recompute:
            if dims.pp == 1 or par.pp_schedule not in ("1f1b", "dualpipev"):
                raise ValueError(
                    "parallel.pp_early_recompute needs a pp dimension and --pp-schedule 1f1b or "
                    f"dualpipev (got --mesh {dims.spec()}, --pp-schedule {par.pp_schedule})"
                )
            if cfg.activation.policy == "none" and not cfg.activation.per_block:
                raise ValueError(
                    "parallel.pp_early_recompute has nothing to replay with --activation none; "
                    "choose a policy that recomputes (recompute, selective)"
                )
        if dims.pp > 1:
            n_stages = self.pipeline_stages(dims)
            split_layers(self.n_layers, n_stages)
            if par.microbatches < n_stages and par.pp_schedule != "1f1b":
                raise ValueError(
                    f"parallel.microbatches={par.microbatches} is below the {n_stages} stages "
                    f"of --pp-schedule {par.pp_schedule} on pp={dims.pp}; use at least {n_stages}"
                )
        return local

    def block_policies(self) -> list[str]:
        """The activation policy of each block: ``activation.per_block``, then ``policy``."""
        act = self.cfg.activation
        return [*act.per_block, *[act.policy] * self.n_layers][: self.n_layers]

    def build(self, meshes: MeshSet, device: torch.device) -> ParallelModel:
        """The model from :meth:`build_module`, each block an activation region with its
        policy, parallelized over ``meshes`` (:meth:`parallelize`)."""
        module = self.build_module(device)
        act = self.cfg.activation
        apply_activation_memory(
            module,
            self.block_policies(),
            swap_inputs=act.swap_inputs,
            swap_threshold_bytes=act.swap_threshold_bytes,
        )
        return self.parallelize(module, meshes, device)

    def parallelize(
        self, module: nn.Module, meshes: MeshSet, device: torch.device
    ) -> ParallelModel:
        """Shard the whole model (:meth:`shard`); a spec that supports pipelines overrides this
        to cut it into stages when ``meshes.pp`` is set."""
        self.shard(module, meshes)
        return ParallelModel(
            module,
            meshes,
            module,
            None,
            self.cfg.optim.balance_weight,
            losses=self.losses(module),
            classify=self.classify(module),
        )

    def pipelined(
        self,
        build: Callable[..., Any],
        module: nn.Module,
        meshes: MeshSet,
        device: torch.device,
        classify: Classifier | None = None,
    ) -> ParallelModel:
        """This rank's pipeline stages of ``module``, cut by ``build`` (the built-in MoE's or a
        transformers decoder's stage builder) under the configured schedule, each stage
        sharded by :meth:`shard`."""
        par = self.cfg.parallel
        weight = self.cfg.optim.balance_weight
        pipeline = build(
            module,
            schedule=par.pp_schedule,
            microbatches=par.microbatches,
            virtual_stages=par.virtual_stages,
            pp_mesh=meshes.pp,
            device=device,
            balance_weight=weight,
            shard=lambda stage: self.shard(stage, meshes),
            early_recompute=par.pp_early_recompute,
        )
        return ParallelModel(pipeline.view, meshes, None, pipeline, weight, classify=classify)

    def shard(self, module: nn.Module, meshes: MeshSet) -> None:
        """Under ep place the experts first, then FSDP2 / HSDP over ``meshes.dense``: one unit
        per block, then the root (embedding, final norm, head)."""
        experts = self.place_experts(module, meshes) if meshes.ep is not None else []
        apply_fsdp(module, meshes.dense, set(experts) or None)
