"""Test, lint, packaging, docs and benchmark sessions for every member of the workspace.

Members are discovered from ``packages/*/pyproject.toml`` and named by their folder
(``tests-mccl``), so a new member gets its sessions without editing this file. The matrix:

- ``tests-<member>-<python>``: the member and what it declares, installed from the committed
  lock, on Python 3.11 (the whole suite) and 3.13 (the quick tests);
- ``floors-<member>``: the same member with every direct dependency at the lowest version its
  ``pyproject.toml`` allows (uv's ``lowest-direct`` resolution, the lock untouched), quick tests;
- ``wheels``: every wheel built, then each installed alone with plain pip into a fresh virtual
  environment, imported, its CLI asked for ``--help`` and its README quick start run;
- ``docs``: the MkDocs site, built with ``--strict``;
- ``tests-all``: every member in one environment, the cross-package checks in ``tests/``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYTHONS = ["3.11", "3.13"]
#: Python of the whole suite, the floors and the wheels (the oldest ``requires-python`` allows).
MAIN_PYTHON = PYTHONS[0]
#: The tests every other cell of the matrix runs: of the member's ``matrix-tests`` (below), those
#: in one process, without multi-rank launches, not marked slow. The main cell (locked, 3.11)
#: runs everything.
QUICK_TESTS = "not slow and not distributed and not device"
MAX_TEST_WORKERS = 4


@dataclass(frozen=True)
class Member:
    """One workspace member as its ``pyproject.toml`` declares it."""

    folder: str
    path: Path
    distribution: str
    module: str
    scripts: tuple[str, ...]
    siblings: tuple[str, ...]
    matrix_tests: tuple[str, ...]
    """Test paths the 3.13 and floors cells run (``[tool.torchmind] matrix-tests`` in the
    member's ``pyproject.toml``: a representative part where the whole quick set would not fit
    CI's time; default ``tests``)."""

    @classmethod
    def read(cls, pyproject: Path) -> Member:
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        (source,) = data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        requirements = [
            *project["dependencies"],
            *(r for extra in project.get("optional-dependencies", {}).values() for r in extra),
            *(r for group in data.get("dependency-groups", {}).values() for r in group),
        ]
        names = {re.split(r"[\s\[<>=~!;]", r)[0] for r in requirements if isinstance(r, str)}
        siblings = tuple(sorted(n for n in names if n.startswith("torchmind-")))
        return cls(
            folder=pyproject.parent.name,
            path=pyproject.parent,
            distribution=project["name"],
            module=Path(source).name,
            scripts=tuple(project.get("scripts", {})),
            siblings=siblings,
            matrix_tests=tuple(
                data.get("tool", {}).get("torchmind", {}).get("matrix-tests", ["tests"])
            ),
        )


MEMBERS = {
    member.folder: member
    for member in map(Member.read, sorted(ROOT.glob("packages/*/pyproject.toml")))
}
BY_DISTRIBUTION = {member.distribution: member for member in MEMBERS.values()}

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "floors", "wheels", "docs", "tests-all"]
nox.options.reuse_existing_virtualenvs = True


def _expose_pyenv_versions() -> None:
    """Let pyenv's shims answer for every installed version, so uv finds ``python3.13``.

    With pyenv, ``python3.13`` on ``PATH`` is a shim that fails unless 3.13 is among the selected
    versions (``PYENV_VERSION``, which pyenv sets for the processes it starts), and uv stops at
    the first failing interpreter it meets. Adding every installed version after the selected
    ones (highest patch first) makes each ``python3.X`` shim resolve while ``python`` keeps its
    meaning. Without pyenv this does nothing.
    """
    if shutil.which("pyenv") is None:
        return
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not root.is_dir():
        return
    installed = sorted(
        (p.name for p in root.iterdir() if re.fullmatch(r"\d+\.\d+\.\d+", p.name)),
        key=lambda v: tuple(map(int, v.split("."))),
        reverse=True,
    )
    selected = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    versions = selected + [v for v in installed if v not in selected]
    if versions:
        os.environ["PYENV_VERSION"] = ":".join(versions)


_expose_pyenv_versions()


def _write_bytecode(session: nox.Session) -> None:
    """Drop an inherited ``PYTHONDONTWRITEBYTECODE`` for everything the session runs.

    A session's environment is new on a fresh clone, and uv installs sources without ``.pyc``
    files. With bytecode writing switched off (as many container images do) every process that
    imports torch compiles it from source again: about 15 s of CPU instead of 5 s per import on
    a two-core machine, paid by each test process, forkserver, torchrun rank, CLI subprocess
    and Inductor compile worker. Written once, the bytecode is reused by every later process.
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = None  # nox leaves a None variable out


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's environment (never re-resolve)."""
    _write_bytecode(session)
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _pytest(session: nox.Session, *args: str | Path) -> None:
    # pytest exits 5 when a selection holds no tests; that is not a failure of the package.
    session.run("pytest", *map(str, args), *session.posargs, success_codes=[0, 5])


def _parallel_pytest(session: nox.Session, *args: str | Path) -> None:
    """``_pytest`` with one pytest-xdist worker per usable core, at most ``MAX_TEST_WORKERS``.

    Much of a package's suite is one process on one core (an Inductor compile, a tiny model
    converted and run, a CLI importing torch before its ranks start); two workers on two cores
    overlap that. ``loadfile`` keeps each test module on one worker, so a module fixture that
    launches shared training runs (hyperparallel's layouts) runs once. ``loadgroup`` would split
    big parametrised modules finer, but under pytest 9.2 it silently stops grouping
    (pytest-xdist issue 1386). The cap: a distributed test starts up to 8 ranks of its own. Extra
    arguments come last: ``-- -n 0`` runs one process.
    """
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    workers = min(cores, MAX_TEST_WORKERS)
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    _pytest(session, *xdist, *args)


def _docs_of(member: Member) -> list[Path]:
    """The Markdown whose Python snippets the member's tests execute: README and docs pages."""
    pages = sorted((ROOT / "docs" / member.folder).glob("*.md"))
    return [member.path / "README.md", *pages]


def _member_tests(session: nox.Session, member: Member, *, quick: bool) -> None:
    """The member's tests (all, or its quick matrix tests) plus every Python snippet of its
    README and docs pages."""
    if quick:
        selection = ["-m", QUICK_TESTS, *(member.path / t for t in member.matrix_tests)]
    else:
        selection = [member.path / "tests"]
    _parallel_pytest(session, "--markdown-docs", *selection, *_docs_of(member))


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Every member in isolation on every Python of the matrix."""
    for folder in MEMBERS:
        for python in PYTHONS:
            session.notify(f"tests-{folder}-{python}")


@nox.session(python=False)
def floors(session: nox.Session) -> None:
    """Every member with its direct dependencies at their declared floors."""
    for folder in MEMBERS:
        session.notify(f"floors-{folder}")


def _sibling_closure(member: Member) -> list[Member]:
    """The member and every workspace member it needs, directly or through another member."""
    found: dict[str, Member] = {}
    pending = [member]
    while pending:
        current = pending.pop()
        if current.folder in found:
            continue
        found[current.folder] = current
        pending += [BY_DISTRIBUTION[name] for name in current.siblings]
    return list(found.values())


for _folder, _member in MEMBERS.items():

    @nox.session(name=f"tests-{_folder}", python=PYTHONS)
    def _package_tests(session: nox.Session, member: Member = _member) -> None:
        _sync(session, "--package", member.distribution, "--group", "test")
        _member_tests(session, member, quick=session.python != MAIN_PYTHON)

    _package_tests.__doc__ = (
        f"{_member.distribution} alone (locked): every test on {MAIN_PYTHON}, quick ones elsewhere."
    )

    # a new environment each run: pip-style installs keep a version that still satisfies a
    # requirement, so a reused one would hide a raised floor behind the version already there
    @nox.session(name=f"floors-{_folder}", python=MAIN_PYTHON, reuse_venv=False)
    def _package_floors(session: nox.Session, member: Member = _member) -> None:
        """Install with ``--resolution lowest-direct``: every requirement a member's
        ``pyproject.toml`` names (its dependencies, its test group, the siblings it needs, taken
        from this checkout) at the lowest version allowed; what those need at its newest."""
        _write_bytecode(session)
        needed = _sibling_closure(member)
        session.run_install(
            "uv",
            "pip",
            "install",
            "--resolution",
            "lowest-direct",
            *(str(m.path) for m in needed),
            "--group",
            f"{member.path / 'pyproject.toml'}:test",
            env={"VIRTUAL_ENV": session.virtualenv.location},
        )
        session.run("uv", "pip", "list", "--python", session.virtualenv.location, silent=False)
        _member_tests(session, member, quick=True)

    _package_floors.__doc__ = (
        f"{_member.distribution} with its direct dependencies at their floors."
    )


@nox.session(name="tests-all", python=MAIN_PYTHON)
def tests_all(session: nox.Session) -> None:
    """All members installed together: the cross-package tests in tests/.

    Each member's own tests already ran in its isolated session, against the same locked
    versions; what only this environment can show (every member importable side by side,
    workspace metadata, the README results tables against their result files) is in tests/.
    """
    _sync(session, "--all-packages", "--group", "dev")
    _pytest(session, ROOT / "tests")


@nox.session(python=MAIN_PYTHON, venv_backend="none")
def wheels(session: nox.Session) -> None:
    """Every wheel, each installed alone with plain pip as a user would.

    ``uv build --all-packages`` fills ``build/wheels``; then, per member, a fresh virtual
    environment gets that one wheel with plain ``pip`` (siblings it declares from the same
    folder, everything else from the package index), imports it, runs each of its CLIs with
    ``--help`` and runs its README quick start (``tools/quickstart.py``). A file missing from a
    wheel, an undeclared import or a wrong requirement fails here.

    torch is the one exception: with its CUDA libraries it is about 5 GB, which pip would unpack
    six times (about 10 of CI's minutes on two cores). pip installs it once into
    ``build/venvs/torch``, and each member's environment sees that environment's site-packages
    through a ``.pth`` line, so pip finds torch installed and checks it against the member's
    requirement like any other installed distribution.
    """
    out = ROOT / "build" / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--wheel", "--out-dir", str(out))
    venvs = ROOT / "build" / "venvs"
    torch_site = _pip_venv(session, venvs / "torch")
    session.run(str(venvs / "torch" / "bin" / "python"), "-m", "pip", "install", "--quiet", "torch")
    for folder in session.posargs or list(MEMBERS):
        member = MEMBERS[folder]
        (wheel,) = out.glob(f"{member.distribution.replace('-', '_')}-*.whl")
        venv = venvs / folder
        (_pip_venv(session, venv) / "shared-torch.pth").write_text(f"{torch_site}\n")
        python = str(venv / "bin" / "python")
        session.log(f"{member.distribution}: pip install {wheel.name}")
        session.run(python, "-m", "pip", "install", "--quiet", "--find-links", str(out), str(wheel))
        session.run(python, "-c", f"import {member.module}; print({member.module}.__version__)")
        for script in member.scripts:
            session.run(str(venv / "bin" / script), "--help", silent=True)
        quickstart = ROOT / "tools" / "quickstart.py"
        readme = member.path / "README.md"
        session.run(python, str(quickstart), str(readme), "--find-links", str(out))


def _pip_venv(session: nox.Session, venv: Path) -> Path:
    """A new virtual environment with pip (the standard library's ``venv``); its site-packages."""
    shutil.rmtree(venv, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    session.run(base, "-m", "venv", str(venv))
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(session.run(str(python), "-c", code, silent=True).strip())


@nox.session(python=MAIN_PYTHON)
def docs(session: nox.Session) -> None:
    """The MkDocs site (Material, mkdocstrings API pages), built with ``--strict``: a broken
    link, a missing page or an unresolvable API reference fails the build."""
    _sync(session, "--all-packages", "--group", "docs")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about its successor, not ours
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "build" / "site"))


@nox.session(python=MAIN_PYTHON)
def device(session: nox.Session) -> None:
    """The device tier: every member's tests marked ``device`` (CUDA or NPU only).

    Not a default session. One pytest run per member, because test files of different members
    may share a basename. Without an accelerator every device test skips with its reason, and a
    member without device tests exits 5 (nothing collected), which is not a failure. Numbers the
    tests record (``record_property``) land in ``bench-results/device/<member>.xml`` and in one
    ``bench-results/device/SUMMARY.md`` headed by the machine they were measured on.
    """
    _sync(session, "--all-packages", "--group", "dev")
    out = ROOT / "bench-results" / "device"
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for folder, member in MEMBERS.items():
        report = out / f"{folder}.xml"
        report.unlink(missing_ok=True)
        session.log(f"{folder}: device tests")
        session.run(
            "pytest",
            str(member.path / "tests"),
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
        reports.append((folder, report))
    machine_code = "from npu_core.bench import machine_line; print(machine_line())"
    machine = session.run("python", "-c", machine_code, silent=True)
    summary = out / "SUMMARY.md"
    summary.write_text(_device_summary(str(machine or "").strip(), reports))
    session.log(f"device tier summary -> {summary}")


def _device_summary(machine: str, reports: list[tuple[str, Path]]) -> str:
    """Markdown: per member and test, the outcome and the numbers the test recorded."""
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


@nox.session(python=MAIN_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree, then mypy ([tool.mypy] files)."""
    # every member installed: mypy follows imports into torch and the sibling packages
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=MAIN_PYTHON)
def bench(session: nox.Session) -> None:
    """Run every packages/*/benchmarks/*.py (or those named: ``-- mfusion/real_models``).

    Each script writes ``<name>.json`` and ``<name>.md`` into its member's
    ``benchmarks/results/``, stamped with the machine and the command; the committed JSON files
    are what the docs' and READMEs' results tables are rendered from.
    """
    # --all-groups: benchmarks may compare against libraries a package only needs for measuring
    _sync(session, "--all-packages", "--all-groups")
    chosen = set(session.posargs)
    for folder, member in MEMBERS.items():
        for script in sorted((member.path / "benchmarks").glob("*.py")):
            if chosen and f"{folder}/{script.stem}" not in chosen and folder not in chosen:
                continue
            session.log(f"{folder}: {script.name}")
            out = member.path / "benchmarks" / "results"
            session.run(
                "python", str(script.relative_to(ROOT)), "--out", str(out.relative_to(ROOT))
            )
