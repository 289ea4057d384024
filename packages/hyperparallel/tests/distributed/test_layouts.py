"""Every mesh layout trains the same model on the same global batch as FSDP: equal first-step
loss (within 1e-4), 20 steps within 1e-3 of FSDP's, and a checkpoint written with one layout
resumes with another (DCP).

One launch per layout returns all 20 losses. The model is the debug preset with 4 blocks (the
fewest that give the V schedules a block per stage on pp=2). The learning rate warms up over
all 20 steps (``optim.warmup_steps`` is 20), so a run's first k losses do not depend on its
``steps`` and a short resumed run can be compared with the long reference.
"""

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
STEPS = 20


def _run(out, mesh: str, *overrides: str, resume: bool = False, nproc: int = 4):
    cfg = load_config(
        debug(), overrides=[f"out_dir={str(out)!r}", f"parallel.mesh={mesh!r}", *BASE, *overrides]
    )
    return launch(train_rank, nproc, cfg, resume, backend=None, timeout=600)[0]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The reference: 4 FSDP ranks, 20 steps, checkpoints at steps 10 and 20."""
    out = tmp_path_factory.mktemp("fsdp")
    return out, _run(out, "fsdp", f"steps={STEPS}", "checkpoint_every=10").train_losses


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
def test_layout_losses_track_fsdp(fsdp_run, tmp_path, mesh, schedule):
    """Same seed, same global batch: the first loss equals FSDP's within 1e-4 (same weights,
    same samples), and each of 20 steps stays within 1e-3 (the layouts' gradients, reduced in
    other orders and with the balance loss taken per micro-batch under PP, feed Muon and AdamW
    for 20 steps).

    dualpipev used to be 4e-4 off at the second step: torch's split input/weight backward gave
    the last stage's block wrong weight gradients (see ``parallel.pipeline``); it now matches
    as closely as 1f1b."""
    _, reference = fsdp_run
    losses = _run(
        tmp_path, mesh, f"steps={STEPS}", f"parallel.pp_schedule={schedule!r}"
    ).train_losses
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(reference[0], abs=1e-4)
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert worst < 1e-3, f"{mesh} {schedule}: largest gap to FSDP over {STEPS} steps {worst:.2e}"


@pytest.mark.slow
def test_eight_rank_layout_losses_track_fsdp(fsdp_run, tmp_path):
    """8 ranks, ``pp=2,ep=2,dp_shard=2`` (1f1b, 2 micro-batches of the 2 samples per
    data-parallel rank): the first loss equals the 4-rank FSDP run's within 1e-4, 20 steps
    within 1e-3 (same global batch of 8, so the same samples)."""
    _, reference = fsdp_run
    losses = _run(
        tmp_path, "pp=2,ep=2,dp_shard=2", f"steps={STEPS}", "parallel.microbatches=2", nproc=8
    ).train_losses
    assert losses[0] == pytest.approx(reference[0], abs=1e-4)
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert worst < 1e-3, f"largest gap to FSDP over {STEPS} steps {worst:.2e}"


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param("pp=2,dp_shard=2", id="to-pp"),
        pytest.param("ep=2,dp_shard=2", id="to-ep", marks=pytest.mark.slow),
        pytest.param("pp=2,ep=2", id="to-pp-ep", marks=pytest.mark.slow),
    ],
)
def test_fsdp_checkpoint_resumes_with_another_layout(fsdp_run, tmp_path, mesh):
    """The FSDP run's step-10 checkpoint, loaded into another layout (DCP reshards by name and
    offset), continues with the uninterrupted FSDP run's losses."""
    out, reference = fsdp_run
    step10 = "step_0000010"
    shutil.copytree(out / "checkpoints" / step10, tmp_path / "checkpoints" / step10)
    (tmp_path / "checkpoints" / "latest").write_text(step10)
    rest = _run(tmp_path, mesh, "steps=12", resume=True)
    assert rest.first_step == 10
    assert rest.train_losses == pytest.approx(reference[10:12], abs=1e-4)


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_with_more_expert_ranks(tmp_path):
    """ep=2 -> ep=4: experts stored on 2 ranks each reload spread over 4 and the loss continues
    as the uninterrupted ep=2 run."""
    full = _run(tmp_path / "full", "ep=2,dp_shard=2", "steps=4").train_losses
    _run(tmp_path / "part", "ep=2,dp_shard=2", "steps=2")
    rest = _run(tmp_path / "part", "ep=4", "steps=4", resume=True)
    assert rest.train_losses == pytest.approx(full[2:], abs=1e-4)
