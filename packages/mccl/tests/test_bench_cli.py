"""``mccl bench``: what cannot work is refused in one line before any rank starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mccl import bench
from mccl.cli import app


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the command got as far as starting ranks."""

    def launched(*_args, **_kwargs):
        raise AssertionError("ranks were started before the refusal")

    monkeypatch.setattr(bench, "launch", launched)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nccl"], "--backend nccl: collective backend 'nccl' cannot run here"),
        (["--backend", "mpi2"], "--backend mpi2: unknown collective backend 'mpi2'; use one of"),
        (["--out", "/proc/x"], "--out /proc/x is not writable"),
        (["--out", "{file}"], "--out {file} is a file; expected a folder for the outputs"),
        (["--out", "{file}/sub"], "--out {file}/sub cannot be created: {file} is a file"),
    ],
)
def test_refused_before_any_rank_starts(tmp_path, no_launch, args, message):
    file = tmp_path / "results.txt"
    file.write_text("the user's notes\n")
    args = [arg.format(file=file) for arg in args]
    result = CliRunner().invoke(app, ["bench", "-n", "2", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"error: {message.format(file=file)}")
    assert file.read_text() == "the user's notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]  # nothing written
