"""npu_core.config: layered loading, strict numbers, one-line errors, stable fingerprints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field, model_validator

from npu_core.config import ConfigError, StrictConfig, parse_value


class Data(StrictConfig):
    seq_len: int = Field(128, ge=8, description="Tokens per sample.")
    fraction: float | None = Field(None, description="Held-out share.")
    path: str | None = Field(None, description="Text file.")


class Run(StrictConfig):
    data: Data = Field(default_factory=Data)
    steps: int = Field(10, ge=1)
    mode: Literal["fast", "exact"] = "exact"
    tags: list[str] = Field(default_factory=list)


def test_layers_apply_in_order(tmp_path: Path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 5\n[data]\nseq_len = 64\npath = "a.txt"\n')
    cfg = Run.load(Run(steps=7), toml, ["data.seq_len=32", 'tags=["x", "y"]'])
    assert (cfg.steps, cfg.data.seq_len, cfg.data.path, cfg.tags) == (5, 32, "a.txt", ["x", "y"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("steps=true", "steps: a boolean is not a number (got True)"),
        ("data.seq_len=false", "data.seq_len: a boolean is not a number (got False)"),
        ("data.fraction=true", "data.fraction: a boolean is not a number (got True)"),
        ("steps=1.5", "steps: Input should be a valid integer"),
        ("data.seq_len=4", "data.seq_len: Input should be greater than or equal to 8 (got 4)"),
        ("mode=quick", "mode: Input should be 'fast' or 'exact' (got 'quick')"),
        ("nope=1", "nope: Extra inputs are not permitted (got 1)"),
    ],
)
def test_bad_values_name_the_key_and_value(override: str, message: str):
    with pytest.raises(ConfigError, match=r"^invalid configuration: ") as err:
        Run.load(overrides=[override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("override", "fields"),
    [
        ("nope=1", ["data", "steps", "mode", "tags"]),
        ("data.seq=1", ["seq_len", "fraction", "path"]),
    ],
)
def test_an_unknown_key_lists_the_fields_of_its_section(override: str, fields: list[str]):
    """The list is the section's own fields, read from the model here, not from the message."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        Run.load(overrides=[override])
    listed = str(err.value).partition(f"{key}: ")[2].partition("choose one of ")[2]
    assert listed.split(", ") == fields


def test_direct_construction_refuses_bool_numbers_too():
    with pytest.raises(ValueError, match="boolean is not a number"):
        Data(seq_len=True)
    assert Data(seq_len=16).seq_len == 16  # a real int still passes


@pytest.mark.parametrize("item", ["steps", "=3", "data..seq_len=3"])
def test_malformed_overrides(item: str):
    with pytest.raises(ConfigError, match=r"--set"):
        Run.load(overrides=[item])


def test_a_value_is_not_a_section():
    with pytest.raises(ConfigError, match=r"--set steps\.sub: steps is a value, not a section"):
        Run.load(Run(), overrides=["steps.sub=3"])
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer"):
        Run.load(overrides=["steps.sub=3"])


def test_missing_and_invalid_toml(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        Run.load(toml_path=tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Run.load(toml_path=bad)


def test_frozen():
    with pytest.raises(ValueError, match="frozen"):
        Run().steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "value"),
    [("3", 3), ("0.5", 0.5), ("true", True), ('"x y"', "x y"), ("word", "word"), ("[1]", [1])],
)
def test_values_use_toml_scalars(text: str, value: object):
    assert parse_value(text) == value


def test_fingerprint_follows_values_not_spelling():
    a = Run.load(overrides=["steps=3", "data.seq_len=64"])
    b = Run.load(overrides=["data.seq_len=64", "steps=3"])
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != Run.load(overrides=["steps=4", "data.seq_len=64"]).fingerprint()
    assert len(a.fingerprint()) == 16


def test_fingerprint_is_stable_across_processes():
    # hash() of strings is salted per process; the fingerprint must not be.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_config as t; "
        "print(t.Run.load(overrides=['steps=3']).fingerprint())"
    )
    here = str(Path(__file__).parent)
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code, here], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert outputs == {Run.load(overrides=["steps=3"]).fingerprint()}


class Window(StrictConfig):
    start: int = 0
    stop: int = 10

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.stop <= self.start:
            raise ValueError(f"stop={self.stop} must exceed start={self.start}")
        return self


def test_a_check_across_fields_reads_as_its_own_message():
    with pytest.raises(ConfigError) as err:
        Window.load(overrides=["start=5", "stop=5"])
    assert str(err.value) == "invalid configuration: stop=5 must exceed start=5"
