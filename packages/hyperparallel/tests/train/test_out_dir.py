"""The run folder: only what a run recorded writing makes it a run, and only that is removed.

The CLI refusals (a run in the folder, --resume with --overwrite, an unwritable folder) are in
``test_failure_behaviour.py``.
"""

from __future__ import annotations

import pytest

from hyperparallel.train.outdir import PROFILE, RUN_ARTEFACTS, prepare_out_dir
from npu_core.run_record import RECORD_NAME, RunRecord


def _users_profile(folder):
    (folder / "profile").mkdir(parents=True)
    (folder / "profile" / "me.txt").write_text("the user's profile")


def test_overwrite_removes_only_the_recorded_artefacts(tmp_path, earlier_run, snapshot):
    """--overwrite deletes the earlier run's metrics and checkpoints; the user's file and the
    user's ``profile/`` (a name the job also uses) stay."""
    earlier_run(tmp_path)
    _users_profile(tmp_path)
    prepare_out_dir(tmp_path, resume=False, overwrite=True)
    kept = {p.as_posix(): data for p, data in snapshot(tmp_path).items()}
    assert kept.pop(RECORD_NAME)  # the new run's record
    assert kept == {"notes.txt": b"the user's own file", "profile/me.txt": b"the user's profile"}
    assert RunRecord(tmp_path).recorded() == list(RUN_ARTEFACTS)


def test_a_users_folder_is_not_a_run_and_is_never_written_into(tmp_path, snapshot):
    """``profile/`` of the user's own is no earlier run: a run without traces takes the folder
    without a flag; a run that would write traces into it is refused, and nothing changes."""
    _users_profile(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="holds profile, which this run would write into"):
        prepare_out_dir(tmp_path, (*RUN_ARTEFACTS, PROFILE), resume=False, overwrite=True)
    assert snapshot(tmp_path) == before
    prepare_out_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "profile" / "me.txt").read_text() == "the user's profile"


def test_a_recorded_symlink_is_unlinked_never_followed(tmp_path, earlier_run):
    """A recorded ``checkpoints`` that is now a symlink: --overwrite removes the link, and the
    folder it points to (elsewhere, the user's) keeps its files."""
    target = tmp_path / "elsewhere"
    (target / "step_0000001").mkdir(parents=True)
    run = tmp_path / "run"
    earlier_run(run)
    for path in sorted((run / "checkpoints").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (run / "checkpoints").rmdir()
    (run / "checkpoints").symlink_to(target)
    prepare_out_dir(run, resume=False, overwrite=True)
    assert not (run / "checkpoints").exists() and (target / "step_0000001").is_dir()


def test_an_unrecorded_symlink_is_refused_not_removed(tmp_path):
    """A ``checkpoints`` symlink the job did not create: refused in one line, link and target
    untouched (before run records, --overwrite ended in an rmtree traceback here)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(target)
    with pytest.raises(ValueError, match="holds checkpoints, which no recorded run wrote"):
        prepare_out_dir(run, resume=False, overwrite=True)
    assert (run / "checkpoints").is_symlink() and target.is_dir()


def test_a_run_without_record_resumes_but_is_not_overwritten(tmp_path, snapshot):
    """A run written before run records: --overwrite cannot tell it from the user's files and
    refuses; --resume takes it over and records what it finds."""
    (tmp_path / "checkpoints" / "step_0000010").mkdir(parents=True)
    (tmp_path / "metrics.json").write_text('{"train": []}')
    before = snapshot(tmp_path)
    for flags in ({"resume": False, "overwrite": False}, {"resume": False, "overwrite": True}):
        with pytest.raises(ValueError, match=r"metrics\.json, checkpoints, which no recorded run"):
            prepare_out_dir(tmp_path, **flags)
        assert snapshot(tmp_path) == before
    prepare_out_dir(tmp_path, resume=True, overwrite=False)
    assert RunRecord(tmp_path).present() == ["metrics.json", "checkpoints"]


def test_other_ranks_only_check(tmp_path, earlier_run, snapshot):
    """Under torchrun one process removes and records; the others change nothing."""
    before = earlier_run(tmp_path)
    prepare_out_dir(tmp_path, resume=False, overwrite=True, owner=False)
    assert snapshot(tmp_path) == before
    prepare_out_dir(tmp_path / "new", resume=False, overwrite=False, owner=False)
    assert not (tmp_path / "new").exists()


def test_a_refused_folder_is_not_created(tmp_path):
    """An out-dir below a file is refused before anything is made."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be created"):
        prepare_out_dir(tmp_path / "file" / "run", resume=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
