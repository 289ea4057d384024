"""Bad input refused before any work (one line on stderr, exit 2, nothing written) and
conversions that never lose or half-write what was there."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchmind_modelzoo import registry
from torchmind_modelzoo.checks import InputError
from torchmind_modelzoo.cli import app, main
from torchmind_modelzoo.convert import convert

SAFETENSORS_CARD = "qwen3-vl-2b-instruct"  # converts in well under a second (no export)
EXPORT_CARD = "qwen3-0.6b"


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its SHA-256: what "nothing written" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    } | {str(p.relative_to(root)) + "/": "" for p in root.rglob("*") if p.is_dir()}


def _refused(args: list[str], root: Path, expected: str) -> None:
    """The command exits 2 with ``expected`` in its single stderr line and writes nothing."""
    before = _tree(root)
    extra_before = {c.id for c in registry.list()}
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert result.stdout == "", result.stdout
    assert _tree(root) == before, "something was written"
    assert {c.id for c in registry.list()} == extra_before, "the registry changed"


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A folder with the usual suspects: an empty folder, a file, a binary and a Latin-1 file."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a folder\n")
    (tmp_path / "weights.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "latin1.yaml").write_bytes("id: caf\xe9\n".encode("latin-1"))
    return tmp_path


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("missing.yaml", "card file '{root}/missing.yaml' does not exist"),
        ("empty", "card file '{root}/empty' is a folder; give the card's .yaml file"),
        ("weights.yaml", "card file '{root}/weights.yaml' is a binary file, not a YAML card"),
        ("latin1.yaml", "card file '{root}/latin1.yaml' is not UTF-8 text (byte 7)"),
    ],
)
def test_validate_refuses_what_is_not_a_card_file(files, name, expected):
    """validate on a missing file, a folder, a binary or non-UTF-8 file: one line, exit 2."""
    _refused(["validate", str(files / name)], files, expected.format(root=files))


def test_convert_without_out_is_refused(files):
    """--out is required: one line naming it."""
    _refused(["convert", EXPORT_CARD, "--tiny"], files, "--out is required")


def test_run_takes_settings_from_config_file_and_set(tmp_path):
    """--config FILE.toml and --set reach the same fields as the options."""
    settings = tmp_path / "run.toml"
    settings.write_text("tiny = true\nboost = false\n")
    result = CliRunner().invoke(
        app, ["run", "bge-reranker-v2-m3", "--config", str(settings), "--set", "dtype=float32"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["tiny"] is True and out["dtype"] == "float32"
    assert out["liteboost"] == {"applied": False, "reason": "disabled"}


def test_validate_checks_every_file_before_reading_any(files):
    """A good card next to a missing one is not registered: nothing is read until all pass."""
    good = files / "my-card.yaml"
    data = registry.get("qwen3-8b").model_dump(mode="json", exclude_none=True) | {"id": "my-card"}
    good.write_text(json.dumps(data))  # JSON is YAML
    _refused(["validate", str(good), str(files / "gone.yaml")], files, "gone.yaml' does not exist")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--path", "{root}/empty"], "--path '{root}/empty' is empty: expected a local copy of"),
        (["--path", "{root}/notes.txt"], "--path '{root}/notes.txt' is a file"),
        (["--path", "{root}/nowhere"], "--path '{root}/nowhere' does not exist"),
        (["--tiny", "--path", "{root}/empty"], "--tiny builds random weights and would ignore"),
        ([], "give --tiny (random weights, offline) or --path DIR"),
        (["--tiny", "--dtype", "int8"], "dtype: Input should be 'float32', 'bfloat16' or"),
        (["--tiny", "--nproc", "0"], "nproc: Input should be greater than or equal to 1"),
        (["--tiny", "--set", "nproc=true"], "nproc: a boolean is not a number (got True)"),
        (["--tiny", "--set", "nprocs=2"], "nprocs: Extra inputs are not permitted"),
        (["--config", "{root}/none.toml"], "--config {root}/none.toml: no such file"),
        (["--tiny", "--nproc", "2", "--path", "{root}/empty"], "--tiny builds random weights"),
    ],
)
def test_run_refuses_bad_source_before_building(files, args, expected):
    """Wrong --path / --tiny combinations and dtypes: one line, exit 2, no rank started."""
    args = [a.format(root=files) for a in args]
    _refused(["run", EXPORT_CARD, *args], files, expected.format(root=files))


def test_run_refuses_pipeline_folder_without_denoiser(files):
    """A diffusers card wants transformer/config.json (or a model folder's config.json)."""
    (files / "pipe").mkdir()
    (files / "pipe" / "model_index.json").write_text("{}")
    _refused(
        ["run", "flux.1-schnell", "--path", str(files / "pipe")],
        files,
        "has no transformer/config.json or config.json",
    )


def test_run_refuses_two_expert_folder_without_second_expert(files):
    """Wan2.2 A14B needs transformer_2/: refused before the first expert is loaded."""
    (files / "wan" / "transformer").mkdir(parents=True)
    (files / "wan" / "transformer" / "config.json").write_text("{}")
    _refused(
        ["run", "wan2.2-t2v-a14b", "--path", str(files / "wan")],
        files,
        "two-expert model and transformer_2/config.json is missing",
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["run", "no-such-model", "--tiny"], "no model card 'no-such-model'"),
        (["run", "minicpm-v-4.5", "--tiny"], "minicpm-v-4.5 is a listed card"),
        (["convert", "minicpm-v-4.5", "--tiny", "--out", "{root}/o"], "is a listed card"),
    ],
)
def test_unknown_or_listed_card_is_refused(files, command, expected):
    """Cards that cannot run: one line naming the card, exit 2."""
    _refused([c.format(root=files) for c in command], files, expected)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["list", "--category", "toy"], "Invalid value for '--category': 'toy': Value error"),
        (["run", "qwen3-0.6b", "--tiny", "--nproc", "two"], "'--nproc': 'two': Input should be"),
        (["run"], "Missing argument 'name'"),
    ],
)
def test_console_script_refuses_what_click_cannot_parse_in_one_line(
    files, monkeypatch, capsys, command, expected
):
    """`modelzoo` itself (main): click's own refusals are one line and exit 2 as well."""
    before = _tree(files)
    monkeypatch.setattr(sys, "argv", ["modelzoo", *command])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert _tree(files) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_convert_refuses_out_that_is_a_file(files, overwrite):
    """--out naming a file is refused even with --overwrite (it never deletes a foreign file)."""
    out = str(files / "notes.txt")
    _refused(
        ["convert", SAFETENSORS_CARD, "--tiny", "--out", out, *overwrite],
        files,
        f"--out '{out}' is a file; give a folder for the artefacts",
    )


def test_convert_refuses_folder_with_other_files(files):
    """A folder holding files convert did not write is not mixed into, with or without
    --overwrite."""
    (files / "mine").mkdir()
    (files / "mine" / "thesis.tex").write_text("...")
    for extra in ([], ["--overwrite"]):
        _refused(
            ["convert", SAFETENSORS_CARD, "--tiny", "--out", str(files / "mine"), *extra],
            files,
            "already holds other files (thesis.tex); give a new or empty folder",
        )


def test_convert_refuses_out_below_a_file(files):
    """An --out whose parent is a file is refused before work."""
    out = files / "notes.txt" / "sub"
    _refused(
        ["convert", SAFETENSORS_CARD, "--tiny", "--out", str(out)],
        files,
        f"--out {out} cannot be created: {files / 'notes.txt'} is a file",
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc")
def test_convert_refuses_unwritable_out(files):
    """--out under /proc (the issue's example) is refused before the model is built."""
    _refused(
        ["convert", SAFETENSORS_CARD, "--tiny", "--out", "/proc/modelzoo-out"],
        files,
        "--out /proc/modelzoo-out is not writable (creating a file in /proc failed",
    )


def test_convert_into_previous_conversion_needs_overwrite(tmp_path):
    """A second conversion into the same folder is refused (files unchanged); --overwrite
    replaces it, and files of the old kind that the new one lacks are removed."""
    out = tmp_path / "out"
    first = CliRunner().invoke(app, ["convert", SAFETENSORS_CARD, "--tiny", "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]
    _refused(
        ["convert", EXPORT_CARD, "--tiny", "--out", str(out)],
        tmp_path,
        "already holds a conversion (config.json, manifest.json, model.safetensors); "
        "pass --overwrite",
    )
    again = CliRunner().invoke(
        app, ["convert", EXPORT_CARD, "--tiny", "--out", str(out), "--overwrite"]
    )
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pt2"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["card"] == EXPORT_CARD
    assert manifest["sha256"] == hashlib.sha256((out / "model.pt2").read_bytes()).hexdigest()


def _disagree(*_args, **_kwargs):
    raise RuntimeError("exported program disagrees with eager (forced by the test)")


def test_failed_overwrite_keeps_the_previous_conversion(tmp_path, monkeypatch):
    """A conversion that fails its check against eager leaves the old one byte for byte."""
    out = tmp_path / "out"
    convert(registry.get(SAFETENSORS_CARD), out, tiny=True)
    before = _tree(tmp_path)
    monkeypatch.setattr("torchmind_modelzoo.convert._check_close", _disagree)
    with pytest.raises(RuntimeError, match="forced by the test"):
        convert(registry.get(EXPORT_CARD), out, tiny=True, overwrite=True)
    assert _tree(tmp_path) == before


def test_failed_conversion_into_new_folder_leaves_nothing(tmp_path, monkeypatch):
    """The folder convert created for a conversion that then failed is removed again."""
    monkeypatch.setattr("torchmind_modelzoo.convert._check_close", _disagree)
    with pytest.raises(RuntimeError, match="forced by the test"):
        convert(registry.get(EXPORT_CARD), tmp_path / "new" / "out", tiny=True)
    assert _tree(tmp_path) == {"new/": ""}


def test_api_raises_input_error_before_building(tmp_path, monkeypatch):
    """The Python API refuses the same inputs with InputError, before the model is built."""

    def _no_build(*_args, **_kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr("torchmind_modelzoo.convert.build_model", _no_build)
    monkeypatch.setattr("torchmind_modelzoo.runner.build_model", _no_build)
    from torchmind_modelzoo.runner import run

    card = registry.get(EXPORT_CARD)
    with pytest.raises(InputError, match="give --tiny or --path, not both"):
        run(card, tiny=True, path=tmp_path)
    with pytest.raises(InputError, match="is empty"):
        convert(card, tmp_path / "out", tiny=False, path=tmp_path)
    assert not (tmp_path / "out").exists()
