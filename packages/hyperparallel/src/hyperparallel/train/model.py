"""The train job's model on its mesh: FSDP2/HSDP, expert parallelism and pipeline stages.

The built-in MoE is built here; a transformers model (``hf.source``) in
:mod:`hyperparallel.train.hf_model`; both into the same
:class:`~hyperparallel.train.parallel_model.ParallelModel`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from hyperparallel.models.moe import MoETransformer
from hyperparallel.models.parallelize import apply_activation_memory, apply_fsdp
from hyperparallel.parallel.expert import apply_expert_parallel
from hyperparallel.parallel.mesh import MeshSet
from hyperparallel.parallel.pipeline import build_pipeline, lm_loss
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.parallel_model import ParallelModel


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
