"""Checkpoint retention (``--keep-checkpoints K``): the newest K step folders stay, the newest
intact one always stays, and nothing but step and staging folders is ever removed."""

from __future__ import annotations

import re
import shutil

import pytest
from typer.testing import CliRunner

from hyperparallel.cli import app
from hyperparallel.train import checkpoint


def _fake_checkpoint(root, step: int):
    folder = root / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"index" * 10)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    checkpoint._write_manifest(folder)
    return folder


def _users_files(root) -> dict[str, bytes]:
    """Files a user keeps beside the checkpoints, none of them a step folder."""
    files = {
        "notes.txt": b"which step was best",
        "best/weights.bin": b"\1" * 32,
        "step_0000001.txt": b"a file, not a step folder",
        ".tmp-mine/keep.txt": b"staging-like, but not a step's",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _no_warning(message: str) -> None:
    raise AssertionError(f"unexpected warning: {message}")


def _names(root) -> list[str]:
    """Step and staging folders under ``root`` (what retention may remove), by name."""
    pattern = re.compile(r"(\.tmp-)?step_\d{7}")
    return sorted(p.name for p in root.iterdir() if pattern.fullmatch(p.name))


def test_prune_keeps_the_newest_k_and_every_users_file(tmp_path):
    """Five saves and K=2: steps 4 and 5 remain, a crashed save's staging folder goes, the
    ``latest`` pointer and the user's files (lookalike names included) stay byte for byte."""
    for step in range(1, 6):
        written = _fake_checkpoint(tmp_path, step)
    (tmp_path / ".tmp-step_0000009").mkdir()  # a save that crashed
    (tmp_path / checkpoint.LATEST).write_text(written.name)
    users = _users_files(tmp_path)
    checkpoint.prune(tmp_path, 2, written=written, warn=_no_warning)
    assert _names(tmp_path) == ["step_0000004", "step_0000005"]
    assert (tmp_path / checkpoint.LATEST).read_text() == "step_0000005"
    assert {name: (tmp_path / name).read_bytes() for name in users} == users


def test_prune_in_step_order_hashes_nothing(tmp_path, monkeypatch):
    """The just-written checkpoint is intact by construction: a run saving in step order never
    re-reads a checkpoint to decide what to remove."""
    for step in range(1, 5):
        written = _fake_checkpoint(tmp_path, step)
    (written / "__0_0.distcp").write_bytes(b"\0")  # would fail verify() if it were read

    def unexpected(path):
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(checkpoint, "verify", unexpected)
    monkeypatch.setattr(checkpoint, "sha256_file", unexpected)
    checkpoint.prune(tmp_path, 1, written=written, warn=_no_warning)
    assert _names(tmp_path) == ["step_0000004"]


@pytest.mark.parametrize(
    ("keep", "remaining"),
    [
        (1, ["step_0000006", "step_0000012"]),
        (2, ["step_0000006", "step_0000010", "step_0000012"]),
        (3, ["step_0000006", "step_0000010", "step_0000012"]),
    ],
)
def test_damaged_newer_checkpoints_never_cost_the_newest_intact_one(tmp_path, keep, remaining):
    """A run resumed from step 5 past damaged steps 10 and 12 saves step 6. With K=1 or 2 the
    newest K by step are damaged, so step 6 (the newest intact) stays as well, with a warning
    naming the faults; with K=3 it is among them. Step 5, no longer the newest intact, goes."""
    _fake_checkpoint(tmp_path, 5)
    (_fake_checkpoint(tmp_path, 10) / ".metadata").unlink()
    (_fake_checkpoint(tmp_path, 12) / "__0_0.distcp").write_bytes(b"\0" * 10)
    written = _fake_checkpoint(tmp_path, 6)
    warnings: list[str] = []
    checkpoint.prune(tmp_path, keep, written=written, warn=warnings.append)
    if keep < 3:
        (warning,) = warnings
        assert re.fullmatch(
            rf"keeping step_0000006 beyond keep_checkpoints={keep}: .* every newer one is "
            r"damaged: step_0000012: .*has 10 bytes, 1024 were written; step_0000010: .*missing",
            warning,
        )
    else:
        assert warnings == []
    assert _names(tmp_path) == remaining
    with pytest.warns(RuntimeWarning, match="resuming from step_0000006"):
        assert checkpoint.latest(tmp_path) == written


def test_prune_leaves_a_symlinked_step_folder_and_its_target(tmp_path):
    """A step folder that is a symlink is the user's: neither counted nor removed."""
    target = _fake_checkpoint(tmp_path / "elsewhere", 1)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_0000001").symlink_to(target)
    _fake_checkpoint(root, 2)
    written = _fake_checkpoint(root, 3)
    checkpoint.prune(root, 1, written=written, warn=_no_warning)
    assert _names(root) == ["step_0000001", "step_0000003"]
    assert checkpoint.verify(target) is None


def test_a_folder_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch):
    """Removal failing (permissions, a busy network share) is named; the save still counts."""
    _fake_checkpoint(tmp_path, 1)
    written = _fake_checkpoint(tmp_path, 2)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    warnings: list[str] = []
    checkpoint.prune(tmp_path, 1, written=written, warn=warnings.append)
    (warning,) = warnings
    assert re.fullmatch(
        r"could not remove old checkpoint .*step_0000001: .*Permission denied.*", warning
    )


def test_keep_below_one_is_refused(tmp_path):
    """The newest checkpoint is always kept: K=0 is an error, not 'remove everything'."""
    written = _fake_checkpoint(tmp_path, 1)
    with pytest.raises(ValueError, match="keep=0: at least 1"):
        checkpoint.prune(tmp_path, 0, written=written, warn=_no_warning)
    assert _names(tmp_path) == ["step_0000001"]


def _train(out, *args: str):
    base = ["train", "--preset", "debug", "--nproc", "2", "--out-dir", str(out)]
    return CliRunner().invoke(app, [*base, *args])


@pytest.mark.parametrize("value", ["0", "-2"])
def test_cli_refuses_keeping_no_checkpoint(tmp_path, value):
    """--keep-checkpoints 0 or below: one line naming the option and the bound, exit 2."""
    result = _train(tmp_path / "run", "--keep-checkpoints", value)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line == (
        "error: invalid configuration: keep_checkpoints: Input should be greater than or equal "
        f"to 1 (got {value})"
    )
    assert not (tmp_path / "run").exists()


def test_cli_help_lists_keep_checkpoints():
    """The option is generated from the config field, its description the help."""
    result = CliRunner().invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    (line,) = [line for line in result.output.splitlines() if "--keep-checkpoints" in line]
    assert "<int>" in line and "Newest checkpoints" in line


@pytest.mark.distributed
def test_training_keeps_k_and_resumes_past_a_damaged_newest(tmp_path):
    """Real ranks: saving every 2 steps with K=2 leaves steps 8 and 10. With step 10 damaged, a
    resume with K=1 saves step 9 and keeps it beside the damaged 10; the next resume starts from
    9. The user's files in the checkpoints folder survive both. (The warning's text is checked by
    the unit tests above: rank 0 prints it to the stderr its launcher's forkserver inherited,
    which belongs to whichever test started that server.)"""
    root = tmp_path / "checkpoints"
    done = _train(
        tmp_path, "--steps", "10", "--set", "checkpoint_every=2", "--keep-checkpoints", "2"
    )
    assert done.exit_code == 0, done.output
    assert _names(root) == ["step_0000008", "step_0000010"]

    shard = next((root / "step_0000010").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    users = _users_files(root)
    (root / ".tmp-step_0000007").mkdir()  # a save that crashed
    resumed = _train(tmp_path, "--resume", "--steps", "9", "--keep-checkpoints", "1")
    assert resumed.exit_code == 0, resumed.output
    assert "steps 8->9" in resumed.output
    assert _names(root) == ["step_0000009", "step_0000010"]

    again = _train(tmp_path, "--resume", "--steps", "10", "--keep-checkpoints", "1")
    assert again.exit_code == 0, again.output
    assert "warning: resuming from step_0000009; skipped newer damaged" in again.output
    assert "steps 9->10" in again.output
    assert _names(root) == ["step_0000010"]
    assert checkpoint.latest(root) == root / "step_0000010"
    assert {name: (root / name).read_bytes() for name in users} == users
