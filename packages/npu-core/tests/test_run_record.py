"""npu_core.run_record: a job removes exactly what it recorded, never the user's files."""

from __future__ import annotations

import pytest

from npu_core.run_record import RECORD_NAME, RunRecord


def _user_files(folder):
    (folder / "profile").mkdir(parents=True)
    (folder / "profile" / "me.txt").write_text("the user's notes")


def test_a_folder_without_a_record_holds_no_run_and_its_files_are_foreign(tmp_path):
    _user_files(tmp_path)
    record = RunRecord(tmp_path)
    assert record.present() == []
    assert record.foreign(["metrics.json", "profile"]) == ["profile"]


def test_remove_deletes_only_claimed_entries(tmp_path):
    _user_files(tmp_path)
    (tmp_path / "notes.md").write_text("mine")
    record = RunRecord(tmp_path)
    record.claim(["metrics.json", "checkpoints"])
    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    assert record.present() == ["metrics.json", "checkpoints"]
    assert record.foreign(["metrics.json", "checkpoints", "profile"]) == ["profile"]
    assert record.remove() == ["metrics.json", "checkpoints"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md", "profile"]
    assert (tmp_path / "profile" / "me.txt").read_text() == "the user's notes"


def test_a_recorded_name_that_became_a_symlink_is_unlinked_not_followed(tmp_path):
    precious = tmp_path / "elsewhere"
    precious.mkdir()
    (precious / "keep.bin").write_text("data")
    run = tmp_path / "run"
    record = RunRecord(run)
    record.claim(["checkpoints"])
    (run / "checkpoints").symlink_to(precious, target_is_directory=True)
    assert record.remove() == ["checkpoints"]
    assert not (run / "checkpoints").exists()
    assert (precious / "keep.bin").read_text() == "data"


def test_claims_accumulate_and_a_damaged_record_claims_nothing(tmp_path):
    record = RunRecord(tmp_path)
    record.claim(["metrics.json"])
    record.claim(["loss.png", "metrics.json"])
    assert record.recorded() == ["metrics.json", "loss.png"]
    (tmp_path / RECORD_NAME).write_text("{not json")
    (tmp_path / "metrics.json").write_text("{}")
    assert record.recorded() == [] and record.remove() == []
    assert (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("name", ["../outside", "a/b", "..", ""])
def test_only_plain_names_can_be_claimed_or_removed(tmp_path, name):
    with pytest.raises(ValueError, match="plain name"):
        RunRecord(tmp_path).claim([name])
    (tmp_path / RECORD_NAME).write_text(f'{{"entries": ["{name}"]}}')
    assert RunRecord(tmp_path).recorded() == []
