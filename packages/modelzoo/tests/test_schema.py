"""Card validation: every kind of wrong card fails with the file and the field named."""

from pathlib import Path

import pytest
import yaml

from torchmind_modelzoo import CardError, registry
from torchmind_modelzoo.validate import check_library, load_card_file


def _good() -> dict:
    return registry.get("qwen3-0.6b").model_dump(mode="json", exclude_none=True)


def _write(tmp_path: Path, data: dict, name: str | None = None) -> Path:
    path = tmp_path / f"{name or data.get('id', 'card')}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_card_roundtrips_through_yaml(tmp_path):
    """A dumped card reloads to an equal card."""
    card = load_card_file(_write(tmp_path, _good()))
    assert card == registry.get("qwen3-0.6b")


def test_unknown_field_is_rejected_with_file_and_field(tmp_path):
    data = _good() | {"flavour": "spicy"}
    with pytest.raises(CardError, match=r"qwen3-0.6b.yaml: field 'flavour': unknown field"):
        load_card_file(_write(tmp_path, data))


def test_unknown_nested_field_is_rejected(tmp_path):
    data = _good()
    data["parallelism"]["pipeline"] = 2
    with pytest.raises(CardError, match=r"field 'parallelism.pipeline': unknown field"):
        load_card_file(_write(tmp_path, data))


def test_bad_category_is_rejected(tmp_path):
    data = _good() | {"category": "robotics"}
    with pytest.raises(CardError, match=r"field 'category'.*'robotics'") as info:
        load_card_file(_write(tmp_path, data))
    assert info.value.field == "category"


@pytest.mark.parametrize("field", ["hub_id", "architecture", "license", "status", "hardware"])
def test_missing_required_field_is_rejected(tmp_path, field):
    data = _good()
    del data[field]
    with pytest.raises(CardError, match=rf"field '{field}': required field is missing"):
        load_card_file(_write(tmp_path, data))


def test_full_card_without_conversion_config_is_rejected(tmp_path):
    data = _good()
    del data["convert"]
    with pytest.raises(CardError, match=r"status 'full' needs convert"):
        load_card_file(_write(tmp_path, data))


def test_bad_library_and_hub_id_are_rejected(tmp_path):
    with pytest.raises(CardError, match=r"field 'library'"):
        load_card_file(_write(tmp_path, _good() | {"library": "tensorflow"}))
    with pytest.raises(CardError, match=r"field 'hub_id'"):
        load_card_file(_write(tmp_path, _good() | {"hub_id": "no-owner"}))


def test_id_must_match_file_name(tmp_path):
    with pytest.raises(CardError, match=r"field 'id'.*must equal the file name 'other'"):
        load_card_file(_write(tmp_path, _good(), name="other"))


def test_card_in_wrong_category_folder_is_rejected(tmp_path):
    folder = tmp_path / "speech"
    folder.mkdir()
    with pytest.raises(CardError, match=r"speech/qwen3-0.6b.yaml: field 'category'"):
        load_card_file(_write(folder, _good()))


def test_architecture_missing_from_installed_library_is_rejected(tmp_path):
    import transformers  # noqa: F401  (test group: a missing library fails, never skips)

    card = load_card_file(_write(tmp_path, _good() | {"architecture": "Qwen9ForCausalLM"}))
    with pytest.raises(CardError, match=r"field 'architecture': 'Qwen9ForCausalLM' is not a class"):
        check_library(card, "qwen3-0.6b.yaml")


def test_library_check_is_skipped_when_package_is_absent(tmp_path):
    data = _good() | {"library": "other:surely-not-installed", "status": "listed"}
    for key in ("tiny", "convert", "example"):
        data.pop(key)
    card = load_card_file(_write(tmp_path, data))
    assert check_library(card, "x") == "library 'surely_not_installed' is not installed"
