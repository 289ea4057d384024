"""Tables of the docs rendered from the repository itself: benchmark results, floors, snippets.

A Markdown page asks for a table with a marker line naming a result file written by a benchmark
(``npu_core.bench.BenchTable.write``), relative to the repository root::

    <!-- results: packages/mfusion/benchmarks/results/real_models.json -->

The docs build (``tools/mkdocs_hooks.py``) replaces the marker with the rendered table. A README,
read on its own, keeps the rendered table between the marker and a closing ``<!-- /results -->``
line; ``python tools/docs_tables.py --write`` refreshes those blocks and the workspace tests
fail while one is stale. Every number shown thus has a file, a command and a machine behind it.

Docs pages may also ask for ``<!-- floors: MEMBER -->`` (the lowest version of each direct
dependency, as the member's ``pyproject.toml`` declares and ``nox -s floors-MEMBER`` tests them)
and ``<!-- snippets: MEMBER -->`` (how many Python snippets of the member's README and docs pages
its test session executes).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path

from npu_core.bench import render_result

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- results: (?P<path>\S+) -->\n", re.M)
BLOCK = re.compile(
    r"^<!-- results: (?P<path>\S+) -->\n(?P<body>.*?)^<!-- /results -->\n", re.M | re.S
)


def render(path: str) -> str:
    """The Markdown table of one committed result file (``path`` relative to the root)."""
    file = ROOT / path
    if not file.is_file():
        raise FileNotFoundError(f"results marker names {path}, which is not a committed file")
    return render_result(json.loads(file.read_text()))


FLOORS = re.compile(r"^<!-- floors: (?P<member>[\w-]+) -->$", re.M)
SNIPPETS = re.compile(r"^<!-- snippets: (?P<member>[\w-]+) -->$", re.M)
PYTHON_FENCE = re.compile(r"^```python(?P<info>[^\n]*)$", re.M)


def _member(folder: str) -> Path:
    path = ROOT / "packages" / folder
    if not (path / "pyproject.toml").is_file():
        raise FileNotFoundError(f"docs marker names member {folder!r}, which does not exist")
    return path


def render_floors(folder: str) -> str:
    """The member's direct requirements with the floor its floors session installs."""
    project = tomllib.loads((_member(folder) / "pyproject.toml").read_text())["project"]
    rows = [("", requirement) for requirement in project["dependencies"]]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        rows += [(extra, requirement) for requirement in requirements]
    lines = ["| requirement | floor tested | extra |", "| --- | --- | --- |"]
    for extra, requirement in rows:
        name = re.split(r"[\s\[<>=~!;]", requirement)[0]
        floor = re.search(r">=\s*([\w.]+)", requirement)
        shown = floor.group(1) if floor else "any (none declared)"
        lines.append(f"| `{name}` | {shown} | {extra or '(always)'} |")
    return "\n".join(lines) + "\n"


def executed_snippets(folder: str) -> int:
    """Python fences of the member's README and docs pages that ``pytest --markdown-docs`` runs."""
    pages = [_member(folder) / "README.md", *sorted((ROOT / "docs" / folder).glob("*.md"))]
    return sum(
        "notest" not in fence["info"]
        for page in pages
        for fence in PYTHON_FENCE.finditer(page.read_text())
    )


def render_snippets(folder: str) -> str:
    count = executed_snippets(folder)
    return (
        f"{count} Python snippets of this package's README and docs pages run in its test "
        f"session (`uv run nox -s tests-{folder}`, pytest-markdown-docs): a snippet that stops "
        "working fails the tests.\n"
    )


def expand_markers(markdown: str) -> str:
    """Every marker (and the block it may already hold) replaced by its freshly rendered table."""
    markdown = BLOCK.sub(lambda m: render(m["path"]), markdown)
    markdown = MARKER.sub(lambda m: render(m["path"]), markdown)
    markdown = FLOORS.sub(lambda m: render_floors(m["member"]), markdown)
    return SNIPPETS.sub(lambda m: render_snippets(m["member"]), markdown)


def refresh_blocks(markdown: str) -> str:
    """README form: each marker keeps its rendered table below it, closed by ``<!-- /results -->``
    (a marker without a block yet gets one)."""
    out: list[str] = []
    lines = markdown.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        marker = MARKER.fullmatch(line)
        if marker is None:
            out.append(line)
            continue
        out += [line, render(marker["path"]), "<!-- /results -->\n"]
        rest = lines[index:]
        if "<!-- /results -->\n" in rest:
            end = rest.index("<!-- /results -->\n")
            # the old block is this marker's only if no other marker opens before its end
            if not any(MARKER.fullmatch(x) for x in rest[:end]):
                index += end + 1
    return "".join(out)


def readmes() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite stale README blocks")
    args = parser.parse_args()
    stale = []
    for readme in readmes():
        text = readme.read_text()
        fresh = refresh_blocks(text)
        if fresh != text:
            stale.append(readme.relative_to(ROOT))
            if args.write:
                readme.write_text(fresh)
    for path in stale:
        print(f"{'refreshed' if args.write else 'stale'}: {path}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
