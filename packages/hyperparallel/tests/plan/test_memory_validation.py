"""The planner's per-rank memory against real runs on gloo ranks (issue 36, item 3): parameter,
gradient and optimizer-state bytes equal the local shards a real rank holds, and the saved
activations of a step are within 10% of what the activation tracker counts on that rank.

Every layout kind (fsdp, hsdp, ep, pp) and rank count (1, 2, 4, 8) is covered at least once, for
the built-in MoE and two transformers families. The runs come from the ``measured_run`` fixture,
so a test that checks other predictions on the same case shares its launch. Activations are not
exact: the prediction assumes balanced routing (every expert gets the same share of the token
slots), the real run routes by its router's scores.
"""

from __future__ import annotations

import pytest

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.inventory import build_meta_model, model_inventory
from hyperparallel.plan.measure import RankMeasurement
from hyperparallel.plan.memory import rank_memory
from hyperparallel.train.config import TrainConfig

pytestmark = pytest.mark.distributed

ACTIVATION_TOLERANCE = 0.10

CASES = [
    pytest.param("moe", 1, "fsdp", (), id="moe-1-fsdp"),
    pytest.param("moe", 2, "ep=2", (), id="moe-2-ep"),
    pytest.param("moe", 2, "pp=2", ("parallel.microbatches=2",), id="moe-2-pp"),
    pytest.param("qwen3", 2, "fsdp", (), id="qwen3-2-fsdp"),
    pytest.param("qwen3-moe", 2, "ep=2", (), id="qwen3-moe-2-ep"),
    pytest.param("qwen3-moe", 2, "ep=2", ("dtype=bf16",), id="qwen3-moe-2-ep-bf16"),
    pytest.param("moe", 4, "2x2", (), id="moe-4-hsdp", marks=pytest.mark.slow),
    pytest.param(
        "qwen3-moe",
        4,
        "pp=2,ep=2",
        ("parallel.microbatches=2",),
        id="qwen3-moe-4-pp-ep",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "moe",
        8,
        "ep=4,dp_shard=2",
        ("model.n_experts=8",),
        id="moe-8-ep-fsdp",
        marks=pytest.mark.slow,
    ),
]


def _check_memory(cfg: TrainConfig, world: int, measured: list[RankMeasurement]) -> None:
    """Assert each rank's bytes against the prediction (printing the activation bytes)."""
    dims = parse_mesh(cfg.parallel.mesh, world)
    meta = build_meta_model(cfg, dims)
    inv = model_inventory(cfg, dims, meta)
    for m in measured:
        predicted = rank_memory(meta, inv, cfg.activation, m.rank)
        counted = m.activation["device_bytes"] + m.activation["host_bytes"]
        counted += m.activation["recomputed_bytes"]
        line = f"rank {m.rank}: activations predicted {predicted.activations.total}, run {counted}"
        print(line)
        assert predicted.params == m.param_bytes, f"rank {m.rank}: parameters"
        assert predicted.grads == m.grad_bytes, f"rank {m.rank}: gradients"
        assert predicted.optimizer == m.optimizer_bytes, f"rank {m.rank}: optimizer state"
        error = abs(predicted.activations.total - counted) / counted
        assert error <= ACTIVATION_TOLERANCE, line


@pytest.mark.parametrize(("family", "world", "mesh", "extra"), CASES)
def test_predicted_memory_matches_the_run(measured_run, family, world, mesh, extra):
    """Shards and optimizer state exact, saved activations within 10%, on every rank."""
    cfg, measured = measured_run(family, world, mesh, extra)
    _check_memory(cfg, world, measured)


def test_bf16_halves_each_ranks_model_state(measured_run):
    """``dtype=bf16``: parameter, gradient and optimizer-state bytes of every rank of a real run
    are half the fp32 run's on the same layout (the planner's bf16 case is checked above)."""
    _, fp32 = measured_run("qwen3-moe", 2, "ep=2", ())
    _, bf16 = measured_run("qwen3-moe", 2, "ep=2", ("dtype=bf16",))
    for full, half in zip(fp32, bf16, strict=True):
        assert 2 * half.param_bytes == full.param_bytes, f"rank {half.rank}: parameters"
        assert 2 * half.grad_bytes == full.grad_bytes, f"rank {half.rank}: gradients"
        assert 2 * half.optimizer_bytes == full.optimizer_bytes, f"rank {half.rank}: optimizer"
