"""The run folder: --overwrite removes only the earlier run's artefacts, --resume keeps them.

The CLI refusals (a run in the folder, --resume with --overwrite, an unwritable folder) are in
``test_failure_behaviour.py``.
"""

from __future__ import annotations

from hyperparallel.train.outdir import prepare_out_dir


def test_overwrite_removes_only_the_earlier_runs_artefacts(tmp_path, earlier_run, snapshot):
    """--overwrite deletes metrics, plot and checkpoints of the earlier run, nothing else."""
    earlier_run(tmp_path)
    prepare_out_dir(tmp_path, resume=False, overwrite=True)
    assert snapshot(tmp_path) == {
        tmp_path.joinpath("notes.txt").relative_to(tmp_path): b"the user's own file"
    }


def test_resume_keeps_the_run_and_other_ranks_never_delete(tmp_path, earlier_run, snapshot):
    """--resume keeps everything; under torchrun only one process removes on --overwrite."""
    before = earlier_run(tmp_path)
    prepare_out_dir(tmp_path, resume=True, overwrite=False)
    assert snapshot(tmp_path) == before
    prepare_out_dir(tmp_path, resume=False, overwrite=True, remove=False)
    assert snapshot(tmp_path) == before
    prepare_out_dir(tmp_path / "new", resume=False, overwrite=False)
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
