"""Checkpoint manifests: a damaged newest checkpoint is skipped, named, and the one before used."""

from __future__ import annotations

import json

import pytest

from hyperparallel.train import checkpoint


def _fake_checkpoint(root, step: int, with_manifest: bool = True):
    folder = root / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"index" * 10)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    if with_manifest:
        checkpoint._write_manifest(folder)
    return folder


def test_intact_checkpoint_verifies_and_is_latest(tmp_path):
    """The manifest lists every file with its size and digest; the newest intact one wins."""
    _fake_checkpoint(tmp_path, 5)
    newest = _fake_checkpoint(tmp_path, 10)
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())["files"]
    assert set(manifest) == {".metadata", "__0_0.distcp"}
    assert manifest["__0_0.distcp"]["bytes"] == 1024
    assert checkpoint.verify(newest) is None
    assert checkpoint.latest(tmp_path) == newest


@pytest.mark.parametrize(
    ("damage", "fault"),
    [
        (lambda f: (f / "__0_0.distcp").write_bytes(b"\0" * 10), "has 10 bytes, 1024 were written"),
        (lambda f: (f / ".metadata").unlink(), ".metadata is missing"),
        (lambda f: (f / "__0_0.distcp").write_bytes(b"\1" * 1024), "does not match its checksum"),
    ],
)
def test_damaged_newest_is_skipped_with_a_warning_naming_the_file(tmp_path, damage, fault):
    """Truncated, missing or altered files: resume falls back to the previous checkpoint."""
    previous = _fake_checkpoint(tmp_path, 5)
    damage(_fake_checkpoint(tmp_path, 10))
    (tmp_path / checkpoint.LATEST).write_text("step_0000010")
    with pytest.warns(
        RuntimeWarning, match=rf"skipped newer damaged checkpoints: step_0000010: .*{fault}"
    ):
        assert checkpoint.latest(tmp_path) == previous


def test_nothing_loadable_is_an_error_naming_each_fault(tmp_path):
    """When every checkpoint is damaged the error lists them all instead of a DCP traceback."""
    for step in (5, 10):
        (_fake_checkpoint(tmp_path, step) / "__0_0.distcp").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"step_0000010: .*missing; step_0000005"):
        checkpoint.latest(tmp_path)


def test_pointer_to_a_deleted_folder_does_not_hide_the_others(tmp_path):
    """`latest` naming a removed folder still finds the intact earlier checkpoints."""
    earlier = _fake_checkpoint(tmp_path, 5)
    (tmp_path / checkpoint.LATEST).write_text("step_0000010")
    assert checkpoint.latest(tmp_path) == earlier
    assert checkpoint.latest(tmp_path / "absent") is None


def test_checkpoint_from_before_manifests_still_loads(tmp_path):
    """A folder with DCP's .metadata but no manifest (older version) is accepted unverified."""
    legacy = _fake_checkpoint(tmp_path, 5, with_manifest=False)
    assert checkpoint.verify(legacy) is None
    (legacy / ".metadata").unlink()
    assert "missing" in checkpoint.verify(legacy)
