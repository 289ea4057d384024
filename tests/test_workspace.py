"""Cross-package checks: the README's promises, package metadata, and dependency hygiene."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))


def _project(package: Path) -> dict:
    return tomllib.loads((package / "pyproject.toml").read_text())


def _import_name(package: Path) -> str:
    """The one top-level module a member's wheel ships (``src/<module>``)."""
    (source,) = _project(package)["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    return Path(source).name


def _distribution_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=~!;]", requirement)[0]


DISTRIBUTIONS = {_project(p)["project"]["name"]: _import_name(p) for p in PACKAGES}
WORKSPACE_IMPORTS = set(DISTRIBUTIONS.values())


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README.md needs a '## Quick start' section with a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_commands_main_job_and_tests():
    """After installing uv, the README asks for two commands: the main job and all tests."""
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("# main job")
    assert commands[1].endswith("# all tests")


def test_readme_lists_every_package():
    """The package table names every workspace member."""
    readme = (ROOT / "README.md").read_text()
    for package in PACKAGES:
        assert f"`{package.name}`" in readme, package.name


def test_readme_package_table_shows_each_current_version():
    """The package table's last column is each member's version as its pyproject.toml says."""
    readme = (ROOT / "README.md").read_text()
    for package in PACKAGES:
        row = re.search(rf"^\| \[`{re.escape(package.name)}`\].*\| ([^|]+) \|$", readme, re.M)
        assert row, f"README.md package table lacks a row for {package.name}"
        assert row.group(1).strip() == _project(package)["project"]["version"], package.name


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_layout_and_version(package):
    """Each member has its own version, changelog entry for it, README, src, tests, benchmarks."""
    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    changelog = (package / "CHANGELOG.md").read_text()
    assert f"## {meta['version']}" in changelog, "CHANGELOG.md lacks the current version"
    for part in ("README.md", "tests", "benchmarks"):
        assert (package / part).exists(), part
    assert (package / "src" / _import_name(package) / "__init__.py").exists()


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_distribution_names_share_the_project_prefix(package):
    """Every member is published as ``torchmind-<folder>``: the bare names ``mccl`` and
    ``modelzoo`` belong to unrelated projects on the package index."""
    assert _project(package)["project"]["name"] == f"torchmind-{package.name}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_sibling_dependencies_carry_a_version_range(package):
    """A sibling requirement has a floor and a ceiling (the next minor release of a 0.x member),
    so a wheel published alone never resolves to an incompatible sibling."""
    meta = _project(package)["project"]
    extras = meta.get("optional-dependencies", {}).values()
    groups = _project(package).get("dependency-groups", {}).values()
    requirements = [
        *meta["dependencies"],
        *(d for e in extras for d in e),
        *(d for g in groups for d in g),
    ]
    for requirement in requirements:
        if isinstance(requirement, str) and _distribution_name(requirement) in DISTRIBUTIONS:
            assert re.search(r">=[\d.]+,<[\d.]+$", requirement), requirement


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_imports_only_declared_siblings(package):
    """A package's source imports no workspace sibling it does not declare as a dependency."""
    meta = _project(package)["project"]
    own = _import_name(package)
    # An optional extra counts as declared: the package must then import it lazily and guarded.
    extras = meta.get("optional-dependencies", {}).values()
    requirements = [*meta["dependencies"], *(dep for extra in extras for dep in extra)]
    declared = {DISTRIBUTIONS.get(_distribution_name(dep)) for dep in requirements}
    for source in (package / "src").rglob("*.py"):
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", source.read_text(), re.M))
        undeclared = (imported & WORKSPACE_IMPORTS) - declared - {own}
        assert not undeclared, f"{source.relative_to(ROOT)} imports {undeclared}"


def test_no_module_imports_torch_npu_at_top_level():
    """torch_npu is optional: only npu_core.npu may import it, and only lazily."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.glob("packages/*/src/**/*.py")
        if re.search(r"^(import torch_npu|from torch_npu)", path.read_text(), re.M)
    ]
    assert offenders == []


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_member_imports_beside_the_others(package):
    """With all members installed in one environment, each one's top-level module imports."""
    module = importlib.import_module(_import_name(package))
    assert module.__version__ == _project(package)["project"]["version"]


def test_readme_results_tables_match_their_result_files():
    """A README's results table is the rendering of the committed result file its marker names
    (refresh with ``uv run python tools/docs_tables.py --write``)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from docs_tables import readmes, refresh_blocks

    stale = [
        str(p.relative_to(ROOT))
        for p in readmes()
        if refresh_blocks(p.read_text()) != p.read_text()
    ]
    assert stale == [], "stale results tables; run: uv run python tools/docs_tables.py --write"


def test_environment_is_read_only_in_each_package_env_module():
    """Each package reads and sets environment variables in its ``env.py`` alone, where they are
    listed with what they do (the README's table comes from there)."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.glob("packages/*/src/**/*.py")
        if path.name != "env.py"
        and re.search(r"os\.environ|os\.getenv|\bgetenv\(", path.read_text())
    ]
    assert offenders == []
