"""Optimizers: Muon with batched Newton-Schulz, and the Muon + AdamW hybrid for whole models."""

from hyperparallel.optim.hybrid import HybridOptimizer, get_hyper_optimizer
from hyperparallel.optim.muon import Muon

__all__ = ["HybridOptimizer", "Muon", "get_hyper_optimizer"]
