"""npu_core.cli: options generated from config fields, layered with --config and --set."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Literal

import pytest
import typer
from pydantic import Field
from typer.testing import CliRunner

from npu_core.cli import HelpGroup, config_options, fail, prose, run_app
from npu_core.config import StrictConfig


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Parallel(StrictConfig):
    nproc: int = Field(4, ge=1, description="Local ranks.")
    timeout_s: float = Field(60.0, gt=0, description="Collective timeout.")


class Job(StrictConfig):
    parallel: Parallel = Field(default_factory=Parallel)
    steps: int = Field(10, ge=1, description="Optimizer steps.")
    mode: Literal["fast", "exact"] = Field("exact", description="Arithmetic.")
    colour: Colour = Field(Colour.RED, description="Plot colour.")
    fast_path: bool = Field(False, description="Take the fast path.")
    out: Path = Field(Path("runs"), description="Output folder.")
    tags: list[str] = Field(default_factory=list, description="Free labels.")


PRESETS = {"default": Job(), "long": Job(steps=100)}


def _app(seen: list) -> typer.Typer:
    app = typer.Typer(add_completion=False)

    @app.command()
    @config_options(
        Job,
        flags={"parallel.nproc": "--nproc"},
        base=lambda args: PRESETS[args["preset"]],
    )
    def run(config: Job, preset: str = "default", resume: bool = False) -> None:
        seen.append((config, preset, resume))

    @app.command()
    def other() -> None:  # a second command keeps typer from collapsing to a single one
        pass

    return app


def _invoke(*args: str):
    seen: list = []
    result = CliRunner().invoke(_app(seen), ["run", *args])
    return result, (seen[0] if seen else None)


def test_defaults_and_explicit_options():
    result, (cfg, preset, resume) = _invoke()
    assert result.exit_code == 0, result.output
    assert cfg == Job() and preset == "default" and resume is False
    result, (cfg, _, resume) = _invoke(
        "--nproc", "2", "--parallel.timeout-s", "5", "--mode", "fast", "--colour", "blue",
        "--fast-path", "--out", "x", "--resume",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert cfg == Job(
        parallel=Parallel(nproc=2, timeout_s=5.0),
        mode="fast",
        colour=Colour.BLUE,
        fast_path=True,
        out=Path("x"),
    )
    assert resume is True


def test_precedence_base_toml_set_option(tmp_path: Path):
    toml = tmp_path / "job.toml"
    toml.write_text("steps = 20\n[parallel]\nnproc = 3\ntimeout_s = 9.0\n")
    result, (cfg, _, _) = _invoke(
        "--preset", "long", "--config", str(toml), "--set", "parallel.nproc=6", "--nproc", "8"
    )
    assert result.exit_code == 0, result.output
    assert (cfg.steps, cfg.parallel.nproc, cfg.parallel.timeout_s) == (20, 8, 9.0)
    result, (cfg, _, _) = _invoke("--preset", "long", "--set", 'tags=["a"]')
    assert (cfg.steps, cfg.tags) == (100, ["a"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "parallel.nproc: Input should be greater than or equal to 1 (got 0)"),
        (["--parallel.timeout-s", "-1"], "parallel.timeout_s: Input should be greater than 0"),
        (["--mode", "quick"], "mode: Input should be 'fast' or 'exact' (got 'quick')"),
        (["--colour", "green"], "colour: Input should be 'red' or 'blue' (got 'green')"),
        (["--set", "steps=true"], "steps: a boolean is not a number (got True)"),
        (["--set", "parallel=3"], "parallel: Input should be a valid dictionary"),
        (["--set", "bogus.key=1"], "bogus: Extra inputs are not permitted"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str):
    result, seen = _invoke(*args)
    assert result.exit_code == 2
    assert seen is None  # the command body never ran
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid configuration: ")
    assert message in lines[0]


def test_help_is_the_field_descriptions():
    result = CliRunner().invoke(_app([]), ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in (
        "--nproc",
        "Local ranks. (default: 4)",
        "--parallel.timeout-s",
        "Arithmetic. One of: fast, exact.",
        "Plot colour. One of: red, blue. (default: red)",
        "--fast-path",
        "--no-fast-path",
        "--config",
        "--set",
    ):
        assert text in result.output, text
    assert "--tags" not in result.output  # a list: only --set reaches it


def test_declaration_errors_are_caught_early():
    with pytest.raises(ValueError, match=r"no field parallel\.bogus"):
        config_options(Job, flags={"parallel.bogus": "--bogus"})
    with pytest.raises(TypeError, match="needs a `config` parameter"):
        config_options(Job)(lambda steps: None)


class Export(StrictConfig):
    out: Path = Field(description="Where the export goes (required).")
    dtype: str = Field("float32", description="Weights dtype.")


def _export_app(seen: list) -> typer.Typer:
    app = typer.Typer(add_completion=False)

    @app.command()
    @config_options(Export)
    def export(
        config: Export,
        overwrite: Annotated[bool, typer.Option("--overwrite", "-f", help="Replace it.")] = False,
    ) -> None:
        seen.append((config, overwrite))

    @app.command()
    def other() -> None:
        pass

    return app


def test_a_required_field_may_come_from_its_option_or_a_layer(tmp_path: Path):
    seen: list = []
    result = CliRunner().invoke(_export_app(seen), ["export", "--out", "x", "-f"])
    assert result.exit_code == 0, result.output
    assert seen == [(Export(out=Path("x")), True)]
    toml = tmp_path / "e.toml"
    toml.write_text('out = "from-toml"\n')
    result = CliRunner().invoke(_export_app(seen), ["export", "--config", str(toml)])
    assert result.exit_code == 0 and seen[-1][0].out == Path("from-toml")
    result = CliRunner().invoke(_export_app(seen), ["export"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: invalid configuration: out: Field required"


def test_own_options_keep_help_and_aliases_under_postponed_annotations():
    # this module uses `from __future__ import annotations`: annotations are strings here
    result = CliRunner().invoke(_export_app([]), ["export", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "-f" in result.output and "Replace it." in result.output


def _run_app(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str, list]:
    """``run_app`` as a console script's ``main()`` runs it: (exit status, stdout, stderr, seen)."""
    seen: list = []
    with pytest.raises(SystemExit) as exited:
        run_app(_app(seen), list(args), prog_name="job")
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 1 if code else 0), out, err, seen


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--steps", "abc"], ["'--steps'", "'abc'", "integer"]),
        (["--parallel.timeout-s", "soon"], ["'--parallel.timeout-s'", "'soon'", "number"]),
        (["--stesp", "3"], ["No such option: --stesp", "--steps"]),
        (["--steps"], ["'--steps' requires an argument"]),
        (["--preset"], ["'--preset' requires an argument"]),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) and x[0].startswith("-") else None,
)
def test_run_app_parse_errors_are_one_line_and_exit_2(capsys, args, parts):
    # the same command line in typer's standalone mode: a multi-line usage box, exit 2
    standalone = CliRunner().invoke(_app([]), ["run", *args])
    assert standalone.exit_code == 2 and len(standalone.stderr.strip().splitlines()) > 1
    code, out, err, seen = _run_app(capsys, "run", *args)
    assert code == 2 and out == "" and seen == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for part in parts:
        assert part in lines[0], lines[0]


def test_run_app_unknown_command_is_one_line(capsys):
    code, _, err, _ = _run_app(capsys, "walk")
    assert code == 2 and err.strip().splitlines() == ["error: No such command 'walk'."]


def test_run_app_keeps_typer_behaviour_otherwise(capsys):
    code, out, err, seen = _run_app(capsys, "run", "--steps", "3", "--nproc", "2")
    assert code == 0 and err == ""
    assert seen[0][0] == Job(steps=3, parallel=Parallel(nproc=2))
    # a value the model refuses: config_options' own one-line error, as before
    code, _, err, seen = _run_app(capsys, "run", "--steps", "0")
    assert code == 2 and seen == [] and err.count("\n") == 1 and "steps" in err
    code, out, err, _ = _run_app(capsys, "run", "--help")
    assert code == 0 and "--parallel.timeout-s" in out and "Optimizer steps." in out
    code, _, err, _ = _run_app(capsys)  # a missing command is a usage error like the others
    assert code == 2 and err == "error: Missing command.\n"
    # a group made with no_args_is_help shows its help instead, with click's status 2
    helpful = typer.Typer(add_completion=False, no_args_is_help=True)
    helpful.command()(lambda: None)
    helpful.command("other")(lambda: None)
    with pytest.raises(SystemExit) as exited:
        run_app(helpful, [], prog_name="job")
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and "Usage: job" in out + err and "error:" not in out + err


def test_run_app_passes_exit_codes_through(capsys):
    app = typer.Typer(add_completion=False)

    @app.command()
    def stop(code: int) -> None:
        if code == 2:
            fail("two is refused")
        raise typer.Exit(code)

    @app.command()
    def crash() -> None:
        raise RuntimeError("a bug")

    for code in (0, 3):
        with pytest.raises(SystemExit) as exited:
            run_app(app, ["stop", str(code)])
        assert exited.value.code == code
    with pytest.raises(SystemExit) as exited:
        run_app(app, ["stop", "2"])
    assert exited.value.code == 2 and capsys.readouterr().err == "error: two is refused\n"
    with pytest.raises(RuntimeError, match="a bug"):  # a bug is a traceback, not a usage error
        run_app(app, ["crash"])


def test_prose_joins_the_lines_of_a_paragraph_and_keeps_layout():
    doc = """First line
        goes on.

        A paragraph wrapped
        for the source, with
        --an-option at a line start.

        \b
        kept
          as written

        Modes:
        - fast: quick
        - exact: careful
          and slow
        \f
        Args:
            hidden: from --help.
        """
    assert prose(doc) == (
        "First line goes on.\n\n"
        "A paragraph wrapped for the source, with --an-option at a line start.\n\n"
        "\b\nkept\n  as written\n\n"
        "Modes:\n- fast: quick\n- exact: careful\n  and slow\n"
        "\f\nArgs:\n    hidden: from --help."
    )
    assert prose(prose(doc)) == prose(doc)
    assert prose(None) is None


def test_help_group_gives_every_command_prose_help():
    app = typer.Typer(cls=HelpGroup)

    @app.callback()
    def _root() -> None:
        """Root help
        on two lines."""

    @app.command()
    def go() -> None:
        """Go somewhere.

        A sentence wrapped
        in the source.
        """

    group = typer.main.get_command(app)
    assert isinstance(group, HelpGroup)
    assert group.help == "Root help on two lines."
    assert group.commands["go"].help == "Go somewhere.\n\nA sentence wrapped in the source."
    result = CliRunner().invoke(app, ["go", "--help"], env={"COLUMNS": "120"})
    assert "A sentence wrapped in the source." in result.output


@pytest.mark.parametrize(("rank", "printed"), [(None, True), ("0", True), ("1", False)])
def test_fail_prints_one_line_on_rank_zero_only(monkeypatch, capsys, rank, printed):
    """Every rank of a torchrun launch refuses the same command line; only rank 0 says so."""
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(typer.Exit) as exited:
        fail("--steps 0 must be at least 1", code=1)
    assert exited.value.exit_code == 1
    expected = "error: --steps 0 must be at least 1\n" if printed else ""
    assert capsys.readouterr().err == expected
