"""Measured gloo runs shared by the tests that check the planner against them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from hyperparallel.plan.measure import RankMeasurement, measure_rank
from hyperparallel.train.config import TrainConfig
from npu_core.dist import launch
from packages.hyperparallel.tests.plan.cases import tiny_config

MeasuredRun = Callable[[str, int, str, tuple[str, ...]], tuple[TrainConfig, list[RankMeasurement]]]


@pytest.fixture(scope="session")
def measured_run(tmp_path_factory: pytest.TempPathFactory) -> MeasuredRun:
    """``measured_run(family, world, mesh, extra)``: the case's config
    (:func:`~cases.tiny_config`) and :func:`measure_rank` of each of its ``world`` ranks,
    launched once per session whichever tests ask for the same case."""

    @functools.cache
    def run(
        family: str, world: int, mesh: str, extra: tuple[str, ...]
    ) -> tuple[TrainConfig, list[RankMeasurement]]:
        cfg = tiny_config(tmp_path_factory.mktemp(f"{family}-{world}"), family, mesh, extra)
        return cfg, launch(measure_rank, world, cfg, timeout=900)

    return run
