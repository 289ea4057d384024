"""Every console script's ``--help`` reads as prose: no sentence is cut by a newline of its source.

typer's rich help keeps a single newline of a docstring (or of a ``help=`` string) as a hard line
break and then wraps the text to the terminal on top of it, so a docstring wrapped at 100
characters shows up at 80 columns as a full line followed by a stub ("... optionally weights
and" / "tokenizer files) or ..."). The check renders the help of every command and subcommand of
every member's console scripts, in process, at two widths and flags a line break that:

* sits at the same pair of words at both widths (a break the wrapping makes moves with the width),
* leaves room on the line for the next word (the wrapping would have put it there),
* cuts a sentence (the line does not end in ``.``, ``:``, ``;``, ``!`` or ``?``), and
* is in the text itself: the two words are separated by a single newline in the command's or an
  option's help, outside a ``\\b`` paragraph (click's mark for lines kept as written).

Paragraph breaks (a blank line), list items, indented lines (examples) and ``\\b`` blocks are
intended breaks and pass.
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import typer
import typer.main
from typer import rich_utils

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (80, 120)
BOX = "│┃║|"
LIST_ITEM = re.compile(r"([-*•] |\d+[.)] )")
SENTENCE_END = ".:;!?"


def _console_scripts() -> dict[str, str]:
    """Script name -> ``module:function`` over every member's ``[project.scripts]``."""
    scripts: dict[str, str] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        scripts.update(project.get("scripts", {}))
    return scripts


SCRIPTS = _console_scripts()


def _load(target: str) -> tuple[Callable[[], object], typer.Typer]:
    """The entry point and the typer app it runs (the one app of its module)."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    apps = [value for value in vars(module).values() if isinstance(value, typer.Typer)]
    assert len(apps) == 1, f"{module_name} should define one typer app, found {len(apps)}"
    return getattr(module, attr), apps[0]


def _command_paths(command: object, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The command itself, then every subcommand depth-first (hidden ones included)."""
    yield path
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _command_paths(sub, (*path, name))


def _help_texts(command: object, path: tuple[str, ...]) -> list[str]:
    """The raw help strings that the help page of ``path`` is made from."""
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    texts = [command.help or ""]  # type: ignore[attr-defined]
    texts += [getattr(param, "help", None) or "" for param in command.params]  # type: ignore[attr-defined]
    # a group's page lists its commands with the first paragraph of their help
    texts += [sub.help or "" for sub in getattr(command, "commands", {}).values()]
    return texts


def _render(
    main: Callable[[], object],
    argv: list[str],
    width: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """What ``argv --help`` prints at ``width`` columns, run through the console script itself."""
    with monkeypatch.context() as patch:
        # typer reads these once at import; set them so the console has this width and no colours
        patch.setattr(rich_utils, "MAX_WIDTH", width)
        patch.setattr(rich_utils, "FORCE_TERMINAL", False)
        patch.setattr(rich_utils, "COLOR_SYSTEM", None)
        patch.setenv("COLUMNS", str(width))  # click's own formatter, where rich is not used
        patch.setenv("TERM", "dumb")
        patch.setattr(sys, "argv", argv)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main()
        out = capsys.readouterr().out
    assert exit_info.value.code in (0, None), f"{' '.join(argv)} exited {exit_info.value.code}"
    widest = max(len(line) for line in out.splitlines())
    assert widest <= width, f"{' '.join(argv)}: a line of {widest} columns at width {width}"
    return out


def _bounds(line: str, width: int) -> tuple[bool, int, int, int] | None:
    """(in a panel, first column of the text, its last column, last column text may use).

    A panel's row is ``│ cells │`` with one column of padding inside each border; outside a
    panel typer pads the text by one column on each side. None for a blank line.
    """
    body = line.rstrip()
    if not body.strip():
        return None
    in_panel = len(body) > 1 and body[0] in BOX and body[-1] in BOX
    inner = body[1:-1] if in_panel else body
    offset = 1 if in_panel else 0
    if not inner.strip(" " + BOX):
        return None  # an empty row of a panel
    start = offset + len(inner) - len(inner.lstrip())
    end = offset + len(inner.rstrip()) - 1
    limit = len(body) - 3 if in_panel else width - 2
    return in_panel, start, end, limit


def find_stray_breaks(rendered: str, width: int) -> set[tuple[str, str]]:
    """(last word, next word) of each line break inside a sentence that the width did not need.

    Candidates only: the caller keeps those present at both widths and in the source text.
    """
    lines = rendered.splitlines()
    breaks: set[tuple[str, str]] = set()
    for above, below in itertools.pairwise(lines):
        upper, lower = _bounds(above, width), _bounds(below, width)
        if upper is None or lower is None or upper[0] != lower[0]:
            continue
        in_panel, start = lower[0], lower[1]
        if in_panel:
            # a continuation line has only the help column; the line above has text there too
            same_cell = start > 2 and above[start - 1] == " " and above[start] != " "
            if not same_cell or not above[start : upper[2] + 1].strip():
                continue
        elif upper[1] != start:
            continue  # an indented line (an example) or the line after one
        text = below[start : lower[2] + 1]
        if LIST_ITEM.match(text):
            continue
        last = above[: upper[2] + 1].split()[-1]
        following = text.split()[0]
        if last[-1] in SENTENCE_END or following[0] in BOX:
            continue
        if upper[2] + 1 + len(following) <= lower[3]:
            breaks.add((last, following))
    return breaks


def _in_source(pair: tuple[str, str], texts: list[str]) -> bool:
    """Whether a single newline of a non-``\\b`` paragraph separates the two words."""
    pattern = re.compile(rf"{re.escape(pair[0])}[ \t]*\n[ \t]*{re.escape(pair[1])}")
    for text in texts:
        for paragraph in re.split(r"\n[ \t]*\n", text):
            if not paragraph.lstrip().startswith("\b") and pattern.search(paragraph):
                return True
    return False


def stray_breaks(
    script: str,
    main: Callable[[], object],
    app: typer.Typer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> list[str]:
    """``script sub: 'word' / 'word'`` for every sentence a stray newline cuts in its help."""
    root = typer.main.get_command(app)
    found: list[str] = []
    for path in _command_paths(root):
        argv = [script, *path, "--help"]
        per_width = [
            find_stray_breaks(_render(main, argv, width, monkeypatch, capsys), width)
            for width in WIDTHS
        ]
        texts = _help_texts(root, path)
        for pair in sorted(set.intersection(*per_width)):
            if _in_source(pair, texts):
                found.append(f"{' '.join([script, *path])}: {pair[0]!r} / {pair[1]!r}")
    return found


def test_every_member_has_a_console_script() -> None:
    assert {"hyperparallel", "liteboost", "mccl", "modelzoo"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_has_no_sentence_cut_by_a_source_newline(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    main, app = _load(SCRIPTS[script])
    found = stray_breaks(script, main, app, monkeypatch, capsys)
    assert not found, "help text keeps a line break of its source inside a sentence:\n" + "\n".join(
        found
    )


CUT = (
    "Run it.\n\nThe second paragraph is long enough to wrap at eighty columns, but it has a cut\n"
    "here in the middle of its sentence, which no width explains."
)
INTENDED = (
    "Run it.\n\n\b\nExamples:\n  sample go --level 2\n  sample go\n\nModes, one a line:\n"
    "- fast: the quick path\n- slow: the careful path\n\nA last paragraph of one sentence."
)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [(CUT, [("cut", "here")]), (INTENDED, [])],
    ids=["stray-newline", "intended-breaks"],
)
def test_the_check_tells_a_stray_newline_from_an_intended_break(
    doc: str,
    expected: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The detector itself, on a plain typer app (no help normalising) with known breaks."""
    app = typer.Typer(add_completion=False)

    @app.callback()
    def _root() -> None:
        """Sample."""

    @app.command(help=doc)
    def go(level: int = 1) -> None:
        """Placeholder."""

    def main() -> None:
        app(prog_name="sample")

    found = stray_breaks("sample", main, app, monkeypatch, capsys)
    assert found == [f"sample go: {a!r} / {b!r}" for a, b in expected]
