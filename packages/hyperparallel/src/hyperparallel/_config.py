"""The strict base of hyperparallel's configurations (model shape, training run).

npu-core's :class:`~npu_core.config.StrictConfig` (unknown keys refused, frozen, ``true`` never
read as a number, layered TOML + ``--set`` loading), plus one rule of this package: floats must
be finite, since no training setting means ``timeout_s=inf`` or ``muon_lr=nan``.
"""

from __future__ import annotations

from pydantic import ConfigDict

from npu_core.config import StrictConfig


class StrictModel(StrictConfig):
    """Base of every hyperparallel configuration section."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
