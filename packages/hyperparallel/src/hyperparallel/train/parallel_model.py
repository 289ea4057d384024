"""What every model of the train job becomes on its mesh: one interface for every layout.

:meth:`ParallelModel.forward_backward` and :meth:`ParallelModel.evaluate` return this rank's mean
loss (None on pipeline ranks without the last stage), and :attr:`ParallelModel.owner` has the full
model's parameter names, for the optimizer and for DCP checkpoints (which therefore reshard
between layouts). Every model spec (:mod:`hyperparallel.train.model_spec`) builds into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hyperparallel.optim.hybrid import Classifier
from hyperparallel.parallel.mesh import MeshSet
from hyperparallel.parallel.pipeline import Pipeline


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
