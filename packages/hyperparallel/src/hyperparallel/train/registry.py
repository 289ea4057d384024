"""The model specs the train job can train, and the one place that chooses between them.

Everything after the choice goes through :class:`~hyperparallel.train.model_spec.ModelSpec`, so
the job, the trainer and the checks never ask which kind of model they hold.
"""

from __future__ import annotations

from hyperparallel.train.config import TrainConfig
from hyperparallel.train.hf_model import TransformersSpec
from hyperparallel.train.model import MoESpec
from hyperparallel.train.model_spec import ModelSpec


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The spec of the model ``cfg`` trains: the transformers model ``hf.source`` names, else
    the built-in MoE of ``cfg.model``. A transformers model is read and checked here.

    Raises:
        FileNotFoundError, ValueError: an ``hf`` section that names no trainable model (see
            :func:`hyperparallel.train.hf_model.resolve`).
    """
    if cfg.hf.source is not None:
        return TransformersSpec(cfg)
    return MoESpec(cfg)
