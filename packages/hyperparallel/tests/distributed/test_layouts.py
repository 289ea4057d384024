"""Every mesh layout trains the same model on the same global batch as FSDP: equal first-step
loss (within 1e-4), and a checkpoint written with one layout resumes with another (DCP)."""

from __future__ import annotations

import shutil

import pytest

from hyperparallel.train.config import load_config
from hyperparallel.train.presets import debug
from hyperparallel.train.trainer import train_rank
from npu_core.dist import launch

pytestmark = pytest.mark.distributed

# 4 blocks so that V schedules get a block per stage on pp=2; one global batch for all layouts;
# fp32 Newton-Schulz so that no comparison depends on the CPU's bf16 support.
BASE = ["model.n_layers=4", "data.global_batch_size=8", "optim.ns_dtype='fp32'", "eval_every=100"]


def _run(out, mesh: str, *overrides: str, resume: bool = False):
    cfg = load_config(
        debug(), overrides=[f"out_dir={str(out)!r}", f"parallel.mesh={mesh!r}", *BASE, *overrides]
    )
    return launch(train_rank, 4, cfg, resume, backend=None, timeout=600)[0]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The reference: 4 FSDP ranks, 4 steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("fsdp")
    return out, _run(out, "fsdp", "steps=4", "checkpoint_every=2").train_losses


LAYOUTS = [
    pytest.param("pp=2,dp_shard=2", "1f1b", id="pp-1f1b"),
    pytest.param("ep=2,dp_shard=2", "1f1b", id="ep"),
    pytest.param("2x2", "1f1b", id="hsdp-alias", marks=pytest.mark.slow),
    pytest.param("ep=4", "1f1b", id="ep4", marks=pytest.mark.slow),
    pytest.param("pp=2,ep=2", "1f1b", id="pp-ep", marks=pytest.mark.slow),
    pytest.param(
        "pp=2,dp_shard=2", "interleaved_1f1b", id="pp-interleaved", marks=pytest.mark.slow
    ),
    pytest.param("pp=2,dp_shard=2", "dualpipev", id="pp-dualpipev", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh", "schedule"), LAYOUTS)
def test_layout_first_step_loss_equals_fsdp(fsdp_run, tmp_path, mesh, schedule):
    """Same seed, same global batch: the first loss equals FSDP's within 1e-4, the second
    (after one optimizer step through this layout's gradients) within 1e-3."""
    _, reference = fsdp_run
    losses = _run(tmp_path, mesh, "steps=2", f"parallel.pp_schedule={schedule!r}").train_losses
    assert losses[0] == pytest.approx(reference[0], abs=1e-4)
    assert losses[1] == pytest.approx(reference[1], abs=1e-3)


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param("pp=2,dp_shard=2", id="to-pp"),
        pytest.param("ep=2,dp_shard=2", id="to-ep", marks=pytest.mark.slow),
        pytest.param("pp=2,ep=2", id="to-pp-ep", marks=pytest.mark.slow),
    ],
)
def test_fsdp_checkpoint_resumes_with_another_layout(fsdp_run, tmp_path, mesh):
    """The FSDP run's step-2 checkpoint, loaded into another layout (DCP reshards by name and
    offset), continues with the uninterrupted FSDP run's losses."""
    out, reference = fsdp_run
    step2 = "step_0000002"
    shutil.copytree(out / "checkpoints" / step2, tmp_path / "checkpoints" / step2)
    (tmp_path / "checkpoints" / "latest").write_text(step2)
    rest = _run(tmp_path, mesh, "steps=4", resume=True)
    assert rest.first_step == 2
    assert rest.train_losses == pytest.approx(reference[2:], abs=1e-4)


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_with_more_expert_ranks(tmp_path):
    """ep=2 -> ep=4: experts stored on 2 ranks each reload spread over 4 and the loss continues
    as the uninterrupted ep=2 run."""
    full = _run(tmp_path / "full", "ep=2,dp_shard=2", "steps=4").train_losses
    _run(tmp_path / "part", "ep=2,dp_shard=2", "steps=2")
    rest = _run(tmp_path / "part", "ep=4", "steps=4", resume=True)
    assert rest.train_losses == pytest.approx(full[2:], abs=1e-4)
