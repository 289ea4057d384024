"""Test, lint and benchmark sessions for every package of the workspace.

Packages are discovered from ``packages/*/pyproject.toml``: a new package gets its
``tests-<name>`` session without editing this file. Each isolated session installs exactly that
package and what it declares, from the committed lock, so a test importing an undeclared sibling
fails there.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = {
    tomllib.loads(path.read_text())["project"]["name"]: path.parent
    for path in sorted(ROOT.glob("packages/*/pyproject.toml"))
}

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's environment (never re-resolve)."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _pytest(session: nox.Session, *paths: str | Path) -> None:
    # pytest exits 5 when a folder holds no tests yet; that is not a failure of the package.
    session.run("pytest", *map(str, paths), *session.posargs, success_codes=[0, 5])


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Every package in isolation, then all together."""
    for name in PACKAGES:
        session.notify(f"tests-{name}")
    session.notify("tests-all")


for _name, _path in PACKAGES.items():

    @nox.session(name=f"tests-{_name}")
    def _package_tests(session: nox.Session, name: str = _name, path: Path = _path) -> None:
        _sync(session, "--package", name, "--group", "test")
        _pytest(session, path / "tests")

    _package_tests.__doc__ = f"{_name} alone: only its declared dependencies installed."


@nox.session(name="tests-all")
def tests_all(session: nox.Session) -> None:
    """All packages installed together: the cross-package tests in tests/.

    Each package's own tests already ran in its isolated session, against the same locked
    versions; running them again here would double CI time without covering anything new. What
    only this environment can show (every member importable side by side, workspace metadata) is
    in tests/.
    """
    _sync(session, "--all-packages", "--group", "dev")
    _pytest(session, ROOT / "tests")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    _sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every packages/*/benchmarks/*.py; each writes JSON + Markdown to bench-results/."""
    _sync(session, "--all-packages")
    out = ROOT / "bench-results"
    for name, path in PACKAGES.items():
        for script in sorted((path / "benchmarks").glob("*.py")):
            session.log(f"{name}: {script.name}")
            session.run("python", str(script), "--out", str(out / name), *session.posargs)
    tables = sorted(out.glob("*/*.md"))
    summary = "\n".join(table.read_text() for table in tables)
    (out / "SUMMARY.md").write_text(summary)
    session.log(f"{len(tables)} tables -> {out / 'SUMMARY.md'}")
