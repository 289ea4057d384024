"""The planner against real runs on gloo ranks (issue 36, item 3): in a steady-state step the
collective calls and bytes the counting hook sees equal the prediction per rank, kind and mesh
dimension, and the Newton-Schulz matrices each rank orthogonalised equal the owner plan's.

One parametrisation covers every layout kind (fsdp, hsdp, ep, pp, and ep with the experts' own
dp_shard / dp_replicate) and pipeline schedule (1f1b, interleaved_1f1b, dualpipev) and every rank
count (1, 2, 4, 8) at least once, for the built-in MoE and two transformers families, without a
full cross product. The expert dispatch's return trips carry what a rank received, which depends
on the routing: for those bytes the sum over the ep group is exact (every routed copy goes out
once and comes back once), a single rank's is not, and the test checks the sum. The plan's
step-time estimate (measured-CPU profile) is printed beside the measured step, with no pass/fail
on time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import transformers

from hyperparallel.parallel.mesh import parse_mesh
from hyperparallel.plan.collectives import predict_collectives
from hyperparallel.plan.inventory import mesh_coords, model_inventory
from hyperparallel.plan.measure import RankMeasurement, measure_rank
from hyperparallel.plan.muon_work import ns_flops, ns_work
from hyperparallel.plan.planner import make_plan
from hyperparallel.plan.profiles import DeviceProfile, measure_cpu
from hyperparallel.train.config import TrainConfig, load_config
from hyperparallel.train.presets import debug
from npu_core.dist import launch
from packages.hyperparallel.tests.tiny_hf import QWEN3_MOE, TINY_HF_SHAPE

pytestmark = pytest.mark.distributed

BASE = [
    "model.n_layers=2",
    "data.global_batch_size=8",
    "data.max_bytes=200000",
    "optim.ns_dtype='fp32'",
]
HF_FAMILIES = {"qwen3": transformers.Qwen3Config, "qwen3-moe": transformers.Qwen3MoeConfig}


def _config(tmp_path: Path, family: str, mesh: str, extra: tuple[str, ...]) -> TrainConfig:
    overrides = [f"parallel.mesh={mesh!r}", f"out_dir={str(tmp_path)!r}", *BASE, *extra]
    if family != "moe":
        fields = {**TINY_HF_SHAPE, "vocab_size": 256}
        for setting in extra:  # the pipeline schedules' four stages need four blocks
            if setting.startswith("model.n_layers="):
                fields["num_hidden_layers"] = int(setting.split("=")[1])
        if family == "qwen3-moe":
            fields.update(QWEN3_MOE)
        HF_FAMILIES[family](**fields).save_pretrained(tmp_path / family)
        overrides.append(f"hf.source={str(tmp_path / family / 'config.json')!r}")
    return load_config(debug(), overrides=overrides)


def _check_bytes(cfg: TrainConfig, world: int, measured: list[RankMeasurement]) -> None:
    dims = parse_mesh(cfg.parallel.mesh, world)
    inventory = model_inventory(cfg, dims)
    ep_sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for m in measured:
        calls: dict[tuple[str, str], int] = defaultdict(int)
        nbytes: dict[tuple[str, str], int] = defaultdict(int)
        balanced = set()
        for c in predict_collectives(cfg, dims, inventory, m.rank):
            calls[(c.kind, c.dim)] += c.calls
            nbytes[(c.kind, c.dim)] += c.bytes
            if c.balanced:
                balanced.add((c.kind, c.dim))
        counted_calls = {key: total.calls for key, total in m.collectives.items()}
        assert counted_calls == dict(calls), f"rank {m.rank}: calls"
        for key, total in m.collectives.items():
            if key in balanced:
                others = tuple(v for d, v in mesh_coords(dims, m.rank).items() if d != "ep")
                ep_sums[(key, others)][0] += total.bytes
                ep_sums[(key, others)][1] += nbytes[key]
            else:
                assert total.bytes == nbytes[key], f"rank {m.rank} {key}"
    for key, (counted, predicted) in ep_sums.items():
        assert counted == predicted, f"{key}: summed over the ep group"


def _check_ns_work(cfg: TrainConfig, world: int, measured: list[RankMeasurement]) -> None:
    work = ns_work(model_inventory(cfg, parse_mesh(cfg.parallel.mesh, world)))
    for m in measured:
        assert sum(m.ns_matrices.values()) == work.matrices[m.rank], f"rank {m.rank}"
        flops = sum(n * ns_flops(rows, cols) for (rows, cols), n in m.ns_matrices.items())
        assert flops == work.flops[m.rank], f"rank {m.rank}"


def _report_estimate(
    cfg: TrainConfig, world: int, measured: list[RankMeasurement], profile: DeviceProfile
) -> None:
    plan = make_plan(cfg, parse_mesh(cfg.parallel.mesh, world), profile)
    slowest = max(m.step_s for m in measured)
    print(
        f"\n{cfg.parallel.mesh}: estimated step {plan.step_seconds:.4f} s, measured {slowest:.4f} s"
    )


@pytest.fixture(scope="module")
def cpu_profile() -> DeviceProfile:
    return measure_cpu()


V_SCHEDULE = ("parallel.microbatches=4", "model.n_layers=4")

CASES = [
    pytest.param("moe", 1, "fsdp", (), id="moe-1-fsdp"),
    pytest.param("moe", 2, "fsdp", (), id="moe-2-fsdp"),
    pytest.param("moe", 2, "ep=2", (), id="moe-2-ep"),
    pytest.param("moe", 2, "pp=2", ("parallel.microbatches=2",), id="moe-2-pp"),
    pytest.param("moe", 4, "2x2", (), id="moe-4-hsdp"),
    pytest.param("moe", 4, "pp=2,dp_shard=2", ("parallel.microbatches=2",), id="moe-4-pp-fsdp"),
    pytest.param("moe", 4, "ep=4", (), id="moe-4-ep"),
    pytest.param("qwen3", 2, "fsdp", (), id="qwen3-2-fsdp"),
    pytest.param("qwen3", 4, "2x2", (), id="qwen3-4-hsdp", marks=pytest.mark.slow),
    pytest.param("qwen3-moe", 2, "ep=2", (), id="qwen3-moe-2-ep"),
    pytest.param("qwen3-moe", 4, "pp=2,ep=2", ("parallel.microbatches=2",), id="qwen3-moe-4-pp-ep"),
    pytest.param("moe", 8, "2x4", (), id="moe-8-hsdp", marks=pytest.mark.slow),
    pytest.param("moe", 4, "ep=2,dp_shard=2", (), id="moe-4-ep-fsdp", marks=pytest.mark.slow),
    pytest.param(
        "qwen3-moe",
        4,
        "ep=2,dp_shard=2",
        ("activation.policy='recompute'",),  # the replayed forward gathers and exchanges again
        id="qwen3-moe-4-ep-fsdp-recompute",
        marks=pytest.mark.slow,
    ),
    pytest.param("moe", 4, "dp_replicate=2,ep=2", (), id="moe-4-hsdp-ep", marks=pytest.mark.slow),
    pytest.param(
        "moe",
        2,
        "pp=2",
        (*V_SCHEDULE, "parallel.pp_schedule='interleaved_1f1b'"),
        id="moe-2-pp-interleaved",
    ),
    pytest.param(
        "moe", 2, "pp=2", (*V_SCHEDULE, "parallel.pp_schedule='dualpipev'"), id="moe-2-pp-dualpipev"
    ),
    pytest.param(
        "qwen3",
        2,
        "pp=2",
        (*V_SCHEDULE, "parallel.pp_schedule='interleaved_1f1b'"),
        id="qwen3-2-pp-interleaved",
    ),
    pytest.param(
        "qwen3-moe",
        2,
        "pp=2",
        (*V_SCHEDULE, "parallel.pp_schedule='dualpipev'"),
        id="qwen3-moe-2-pp-dualpipev",
    ),
]


@pytest.mark.parametrize(("family", "world", "mesh", "extra"), CASES)
def test_prediction_equals_counted_run(tmp_path, cpu_profile, family, world, mesh, extra):
    """Collective calls and bytes, and NS work, as predicted on every rank of a real run."""
    cfg = _config(tmp_path, family, mesh, extra)
    measured = launch(measure_rank, world, cfg, timeout=900)
    _check_bytes(cfg, world, measured)
    _check_ns_work(cfg, world, measured)
    _report_estimate(cfg, world, measured, cpu_profile)
