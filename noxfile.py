"""Test, lint and benchmark sessions for every package of the workspace.

Packages are discovered from ``packages/*/pyproject.toml``: a new package gets its
``tests-<name>`` session without editing this file. Each isolated session installs exactly that
package and what it declares, from the committed lock, so a test importing an undeclared sibling
fails there.
"""

from __future__ import annotations

import os
import tomllib
import xml.etree.ElementTree as ET
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

MAX_TEST_WORKERS = 4


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's environment (never re-resolve), and let its
    Python processes cache bytecode there."""
    _write_bytecode(session)
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _write_bytecode(session: nox.Session) -> None:
    """Drop an inherited ``PYTHONDONTWRITEBYTECODE`` for everything the session runs.

    A session's environment is new on a fresh clone, and uv installs sources without ``.pyc``
    files. With bytecode writing switched off (as many container images do) every process that
    imports torch compiles it from source again: about 15 s of CPU instead of 5 s per import on
    a two-core machine, paid by each test process, forkserver, torchrun rank, CLI subprocess
    and Inductor compile worker. Written once, the bytecode is reused by every later process.
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = None  # nox leaves a None variable out


def _pytest(session: nox.Session, *args: str | Path) -> None:
    # pytest exits 5 when a folder holds no tests yet; that is not a failure of the package.
    session.run("pytest", *map(str, args), *session.posargs, success_codes=[0, 5])


def _parallel_pytest(session: nox.Session, *paths: str | Path) -> None:
    """``_pytest`` with one pytest-xdist worker per usable core, at most ``MAX_TEST_WORKERS``.

    Much of a package's suite is one process on one core (an Inductor compile, a tiny model
    converted and run, a CLI importing torch before its ranks start); two workers on two cores
    overlap that (a fresh clone's full run: 31:51 -> 20:56 min). ``loadfile`` keeps each test
    module on one worker, so a module fixture that launches shared training runs (hyperparallel's
    layouts) runs once. ``loadgroup`` would split big parametrised modules finer, but under
    pytest 9.2 it silently stops grouping (pytest-xdist issue 1386). The cap: a distributed test
    starts up to 8 ranks of its own. Extra arguments come last: ``-- -n 0`` runs one process.
    """
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    workers = min(cores, MAX_TEST_WORKERS)
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    _pytest(session, *xdist, *paths)


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
        _parallel_pytest(session, path / "tests")

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
def device(session: nox.Session) -> None:
    """The device tier: every package's tests marked ``device`` (CUDA or NPU only).

    Not a default session. One pytest run per package, because test files of different packages
    may share a basename. Without an accelerator every device test skips with its reason, and a
    package without device tests exits 5 (nothing collected), which is not a failure. Numbers the
    tests record (``record_property``) land in ``bench-results/device/<package>.xml`` and in one
    ``bench-results/device/SUMMARY.md`` headed by the machine they were measured on.
    """
    _sync(session, "--all-packages", "--group", "dev")
    out = ROOT / "bench-results" / "device"
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for name, path in PACKAGES.items():
        report = out / f"{name}.xml"
        report.unlink(missing_ok=True)
        session.log(f"{name}: device tests")
        session.run(
            "pytest",
            str(path / "tests"),
            "-m",
            "device",
            "-rs",
            f"--junitxml={report}",
            # xunit1 keeps record_property values in the report (xunit2 warns and drops them)
            "-o",
            "junit_family=xunit1",
            *session.posargs,
            success_codes=[0, 5],
        )
        reports.append((name, report))
    machine_code = "from npu_core.bench import machine_line; print(machine_line())"
    machine = session.run("python", "-c", machine_code, silent=True)
    summary = out / "SUMMARY.md"
    summary.write_text(_device_summary(str(machine or "").strip(), reports))
    session.log(f"device tier summary -> {summary}")


def _device_summary(machine: str, reports: list[tuple[str, Path]]) -> str:
    """Markdown: per package and test, the outcome and the numbers the test recorded."""
    lines = ["# Device tier", "", machine, "", "| package | test | outcome | numbers |"]
    lines.append("| --- | --- | --- | --- |")
    for name, report in reports:
        if not report.exists():
            continue
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("skipped", "failure", "error"):
                element = case.find(tag)
                if element is not None:
                    outcome = f"{tag}: {element.get('message', '')}".strip()
                    break
            numbers = ", ".join(
                f"{prop.get('name')}={prop.get('value')}" for prop in case.iter("property")
            )
            test = case.get("name", "")
            lines.append(f"| {name} | {test} | {outcome.replace('|', '/')} | {numbers} |")
    return "\n".join(lines) + "\n"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree, then mypy ([tool.mypy] files)."""
    # every member installed: mypy follows imports into torch and the sibling packages
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every packages/*/benchmarks/*.py; each writes JSON + Markdown to bench-results/."""
    # --all-groups: benchmarks may compare against libraries a package only needs for measuring
    _sync(session, "--all-packages", "--all-groups")
    out = ROOT / "bench-results"
    for name, path in PACKAGES.items():
        for script in sorted((path / "benchmarks").glob("*.py")):
            session.log(f"{name}: {script.name}")
            session.run("python", str(script), "--out", str(out / name), *session.posargs)
    tables = sorted(out.glob("*/*.md"))
    summary = "\n".join(table.read_text() for table in tables)
    (out / "SUMMARY.md").write_text(summary)
    session.log(f"{len(tables)} tables -> {out / 'SUMMARY.md'}")
