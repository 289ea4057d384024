"""The run folder: an earlier run is never mixed into or lost, and an unwritable folder is refused
before any rank starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hyperparallel.cli import app
from hyperparallel.train.outdir import prepare_out_dir


def _earlier_run(folder):
    (folder / "checkpoints" / "step_0000010").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("step_0000010")
    (folder / "metrics.json").write_text('{"train": []}')
    (folder / "notes.txt").write_text("the user's own file")
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _message(result) -> str:
    return " ".join(result.output.replace("│", " ").split())  # rich wraps errors in a box


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "already holds a run (metrics.json, checkpoints); pass --resume"),
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    ],
)
def test_cli_refuses_to_mix_runs_and_touches_nothing(tmp_path, flags, message):
    """Exit 2 with one clear reason, before any rank starts; the earlier run is unchanged."""
    before = _earlier_run(tmp_path)
    result = CliRunner().invoke(
        app, ["train", "--preset", "debug", "--out-dir", str(tmp_path), *flags]
    )
    assert result.exit_code == 2
    assert message in _message(result)
    assert _files(tmp_path) == before


def test_cli_refuses_an_unwritable_out_dir(tmp_path):
    """A folder that cannot be created is refused at once, not at the first checkpoint."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(
        app, ["train", "--preset", "debug", "--out-dir", str(blocker / "run")]
    )
    assert result.exit_code == 2
    assert "cannot be written" in _message(result)


def test_overwrite_removes_only_the_earlier_runs_artefacts(tmp_path):
    """--overwrite deletes metrics, plot and checkpoints of the earlier run, nothing else."""
    _earlier_run(tmp_path)
    prepare_out_dir(tmp_path, resume=False, overwrite=True)
    assert _files(tmp_path) == {
        tmp_path.joinpath("notes.txt").relative_to(tmp_path): b"the user's own file"
    }


def test_resume_keeps_the_run_and_other_ranks_never_delete(tmp_path):
    """--resume keeps everything; under torchrun only one process removes on --overwrite."""
    before = _earlier_run(tmp_path)
    prepare_out_dir(tmp_path, resume=True, overwrite=False)
    assert _files(tmp_path) == before
    prepare_out_dir(tmp_path, resume=False, overwrite=True, remove=False)
    assert _files(tmp_path) == before
    prepare_out_dir(tmp_path / "new", resume=False, overwrite=False)
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
