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
        """The bytes of ``data.path`` as token ids.

        Raises:
            ValueError, FileNotFoundError: as :func:`read_corpus`; also a ``model.vocab_size``
                without an embedding row for every byte value in the data (an IndexError in
                the first forward of every rank otherwise).
        """
        data, vocab = self.cfg.data, self.cfg.model.vocab_size
        corpus = read_corpus(data.path, data.max_bytes)
        batches = ByteBatches(corpus, data.seq_len, data.val_fraction, self.cfg.seed)
        largest = int(max(batches.train.max(), batches.val.max()))
        if largest >= vocab:
            raise ValueError(
                f"model.vocab_size={vocab} is below the byte vocabulary: the data holds byte "
                f"value {largest}; use model.vocab_size=256 (every byte value)"
            )
        return batches

    def parameter_count(self) -> tuple[int, str]:
        """Embedding and head ``V x D``; per block two norms, q/k/v/output ``4 D^2``, the router
        ``D x E`` and the experts ``3 E x D x F``; the final norm."""
        m = self.cfg.model
        block = 2 * m.dim + 4 * m.dim**2 + m.dim * m.n_experts + 3 * m.n_experts * m.dim * m.ffn_dim
        count = 2 * m.vocab_size * m.dim + m.n_layers * block + m.dim
        settings = (
            f"the built-in MoE (model.dim={m.dim}, model.n_layers={m.n_layers}, "
            f"model.n_experts={m.n_experts}, model.ffn_dim={m.ffn_dim}, "
            f"model.vocab_size={m.vocab_size})"
        )
        return count, settings

    def build_module(self, device: torch.device) -> nn.Module:
        """The whole model from ``cfg.seed``, so every layout starts from the same weights; under
        ``dtype=bf16`` the fp32 weights rounded (the RoPE tables stay fp32)."""
        torch.manual_seed(self.cfg.seed)
        module = MoETransformer(self.cfg.model).to(device)
        for param in module.parameters():
            param.data = param.data.to(self.dtype)
        return module

    def place_experts(self, module: nn.Module, meshes: MeshSet) -> list[nn.Parameter]:
        return apply_expert_parallel(module, meshes, self.expert_dispatch())

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
        return self.pipelined(build_pipeline, module, meshes, device)
