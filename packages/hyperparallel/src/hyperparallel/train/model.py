"""The train job's model on its mesh: FSDP2/HSDP, expert parallelism and pipeline stages.

One interface for every layout: :meth:`ParallelModel.forward_backward` and
:meth:`ParallelModel.evaluate` return this rank's mean loss (None on pipeline ranks without the
last stage), and :attr:`ParallelModel.owner` has the full model's parameter names, for the
optimizer and for DCP checkpoints (which therefore reshard between layouts).

The built-in MoE is built here; a transformers model (``hf.source``) in
:mod:`hyperparallel.train.hf_model`, into the same :class:`ParallelModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hyperparallel.models.moe import MoETransformer
from hyperparallel.models.parallelize import apply_activation_memory, apply_fsdp
from hyperparallel.optim.hybrid import Classifier
from hyperparallel.parallel.expert import apply_expert_parallel
from hyperparallel.parallel.mesh import MeshSet
from hyperparallel.parallel.pipeline import Pipeline, build_pipeline, lm_loss
from hyperparallel.train.config import TrainConfig


@dataclass
class ParallelModel:
    """This rank's share of the model and how to run a step on it."""

    owner: nn.Module
    """Parameters under the full model's names (the model itself, or the pipeline's view)."""
    meshes: MeshSet
    model: nn.Module | None
    pipeline: Pipeline | None
    balance_weight: float
    losses: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    """``(inputs, targets) -> (mean cross-entropy, balance loss)`` of the whole model (not
    under PP); a transformers CausalLM is one itself."""
    classify: Classifier | None = None
    """The optimizer's routing (``get_hyper_optimizer(classify=...)``); None: its default."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this rank's batch (``[B, S]`` int64); the detached mean
        cross-entropy, or None on a pipeline rank that does not hold the last stage."""
        if self.pipeline is not None:
            return self.pipeline.step(inputs, targets)
        assert self.losses is not None
        loss, balance = self.losses(inputs, targets)
        (loss + self.balance_weight * balance).backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward-only mean cross-entropy (None where the last stage is not held)."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(inputs, targets)
        assert self.losses is not None
        return self.losses(inputs, targets)[0]


def _moe_losses(model: MoETransformer) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    def losses(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits, balance = model(inputs)
        return lm_loss(logits, targets), balance

    return losses


def build_model(cfg: TrainConfig, meshes: MeshSet, device: torch.device) -> ParallelModel:
    """Build the whole model from ``cfg.seed`` (every layout starts from the same weights), apply
    the block activation policies, then cut it into pipeline stages (pp > 1), place the experts
    (ep > 1) and shard the rest with FSDP2 / HSDP over ``meshes.dense``.

    With ``cfg.hf.source`` the transformers model is built instead
    (:func:`hyperparallel.train.hf_model.build`)."""
    if cfg.hf.source is not None:
        from hyperparallel.train import hf_model

        return hf_model.build(cfg, hf_model.resolve(cfg), meshes, device)
    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg.model).to(device)
    act = cfg.activation
    policies = [*act.per_block, *[act.policy] * cfg.model.n_layers][: cfg.model.n_layers]
    apply_activation_memory(
        model, policies, swap_inputs=act.swap_inputs, swap_threshold_bytes=act.swap_threshold_bytes
    )

    def shard(module: nn.Module) -> None:
        experts = apply_expert_parallel(module, meshes) if meshes.ep is not None else []
        apply_fsdp(module, meshes.dense, set(experts) or None)

    weight = cfg.optim.balance_weight
    if meshes.pp is None:
        shard(model)
        return ParallelModel(model, meshes, model, None, weight, losses=_moe_losses(model))
    par = cfg.parallel
    pipeline = build_pipeline(
        model,
        schedule=par.pp_schedule,
        microbatches=par.microbatches,
        virtual_stages=par.virtual_stages,
        pp_mesh=meshes.pp,
        device=device,
        balance_weight=weight,
        shard=shard,
        early_recompute=par.pp_early_recompute,
    )
    return ParallelModel(pipeline.view, meshes, None, pipeline, weight)
