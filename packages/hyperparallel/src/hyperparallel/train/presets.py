"""Named, complete training configurations."""

from __future__ import annotations

from collections.abc import Callable

from hyperparallel.models.moe import MoEConfig
from hyperparallel.train.config import DataConfig, TrainConfig


def default() -> TrainConfig:
    """The README's main job: a few minutes on 2 CPU cores, loss visibly falling."""
    return TrainConfig()


def debug() -> TrainConfig:
    """Seconds-long runs for tests: a tiny model on short sequences."""
    return TrainConfig(
        model=MoEConfig(dim=32, n_layers=1, n_heads=2, n_experts=4, ffn_dim=32, max_seq_len=32),
        data=DataConfig(seq_len=32, batch_size=4, max_bytes=200_000),
        steps=20,
        eval_every=10,
        eval_batches=2,
        checkpoint_every=10,
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {"default": default, "debug": debug}
