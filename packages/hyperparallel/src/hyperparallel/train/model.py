"""The built-in MoE transformer as a model spec: FSDP2/HSDP, expert parallelism, pipeline stages.

The only model of the job that pipelines: :meth:`MoESpec.parallelize` cuts it into stages under
``pp`` and shards each stage. Its shape checks against the data and the activation settings are
the configuration's own (:class:`~hyperparallel.train.config.TrainConfig`), made when it loads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hyperparallel.data.stdlib_bytes import ByteBatches, read_corpus
from hyperparallel.models.moe import MoETransformer
from hyperparallel.parallel.expert import apply_expert_parallel, check_divisible
from hyperparallel.parallel.mesh import MeshSet, ParallelDims
from hyperparallel.parallel.pipeline import build_pipeline, lm_loss
from hyperparallel.train.model_spec import Losses, ModelSpec
from hyperparallel.train.parallel_model import ParallelModel


class MoESpec(ModelSpec):
    """The built-in MoE of ``cfg.model``, trained on the bytes of ``data.path``."""

    @property
    def n_layers(self) -> int:
        return self.cfg.model.n_layers

    def check_model_layout(self, dims: ParallelDims) -> None:
        """Whole experts per rank under ep (every layout, pipelines included, is supported)."""
        if dims.ep > 1:
            check_divisible(self.cfg.model.n_experts, dims.ep, dims.dp_shard, "model.n_experts")

    def batches(self) -> ByteBatches:
        data = self.cfg.data
        corpus = read_corpus(data.path, data.max_bytes)
        return ByteBatches(corpus, data.seq_len, data.val_fraction, self.cfg.seed)

    def build_module(self, device: torch.device) -> nn.Module:
        """The whole model from ``cfg.seed``, so every layout starts from the same weights."""
        torch.manual_seed(self.cfg.seed)
        return MoETransformer(self.cfg.model).to(device)

    def place_experts(self, module: nn.Module, meshes: MeshSet) -> list[nn.Parameter]:
        return apply_expert_parallel(module, meshes)

    def losses(self, module: nn.Module) -> Losses:
        def losses(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
            logits, balance = module(inputs)
            return lm_loss(logits, targets), balance

        return losses

    def parallelize(
        self, module: nn.Module, meshes: MeshSet, device: torch.device
    ) -> ParallelModel:
        """Without pp, shard the whole model; with pp, keep this rank's stages (contiguous
        blocks) and shard each, under the configured schedule."""
        if meshes.pp is None:
            return super().parallelize(module, meshes, device)
        assert isinstance(module, MoETransformer)
        par = self.cfg.parallel
        weight = self.cfg.optim.balance_weight
        pipeline = build_pipeline(
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
        return ParallelModel(pipeline.view, meshes, None, pipeline, weight)
