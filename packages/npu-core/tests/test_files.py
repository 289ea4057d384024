"""npu_core.files: outputs are complete or absent, with ordinary file permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from npu_core.files import atomic_path, sha256_file, write_text_atomic


def test_written_file_has_the_mode_open_would_give(tmp_path):
    """Not mkstemp's 0600: group and others get what the umask allows, as for open()."""
    old = os.umask(0o022)
    try:
        path = write_text_atomic(tmp_path / "sub" / "metrics.json", "{}")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644
    assert path.read_text() == "{}"


def test_failure_leaves_the_old_file_and_no_temporary(tmp_path):
    """An exception while writing keeps the previous content and removes the temporary file."""
    target = write_text_atomic(tmp_path / "result.md", "old")
    seen = []

    def write_then_fail() -> None:
        with atomic_path(target) as tmp:
            seen.append(tmp)
            tmp.write_text("half")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_then_fail()
    assert seen[0].parent == tmp_path and seen[0].suffix == ".md" and seen[0] != target
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.md"]


def test_sha256_file_equals_hashlib_on_the_whole_content(tmp_path):
    """Block-wise hashing gives the digest of the whole file (larger than one block)."""
    import hashlib

    data = bytes(range(256)) * 5000
    (tmp_path / "blob").write_bytes(data)
    assert sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()


def test_check_writable_folder_accepts_new_and_existing_folders_and_creates_nothing(tmp_path):
    from npu_core.files import check_writable_folder

    check_writable_folder(tmp_path)
    check_writable_folder(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []  # neither the folders nor the probe file are left


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda base: base / "notes.txt", "is a file; expected a folder"),
        (lambda base: base / "notes.txt" / "out", "cannot be created: .*notes.txt is a file"),
        # /proc takes no new files, whoever asks (the tests may run as root)
        (lambda base: Path("/proc/out"), "is not writable .*/proc failed"),
    ],
)
def test_check_writable_folder_refuses_what_cannot_hold_outputs(tmp_path, make, message):
    from npu_core.files import UnwritableFolderError, check_writable_folder

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UnwritableFolderError, match=message):
        check_writable_folder(make(tmp_path))
