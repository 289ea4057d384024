"""The job's optimizer: Muon for the hidden matrices and AdamW for the rest, from ``cfg.optim``.

One function so that the trainer and the planner's measured runs step with the same settings.
"""

from __future__ import annotations

from hyperparallel.optim import get_hyper_optimizer
from hyperparallel.optim.hybrid import HybridOptimizer
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.parallel_model import ParallelModel


def build_optimizer(cfg: TrainConfig, net: ParallelModel) -> HybridOptimizer:
    """Muon (lr, weight decay, NS dtype) and AdamW (lr, weight decay) over ``net.owner``'s
    parameters, routed by the model spec's ``net.classify``."""
    opt = cfg.optim
    return get_hyper_optimizer(
        net.owner,
        muon={"lr": opt.muon_lr, "weight_decay": opt.weight_decay, "ns_dtype": opt.ns_dtype},
        adamw={"lr": opt.adamw_lr, "weight_decay": opt.weight_decay},
        classify=net.classify,
    )
