"""Cross-package checks: the README's promises, package metadata, and dependency hygiene."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
WORKSPACE_IMPORTS = {"npu_core", "mccl", "hyperparallel", "mfusion", "liteboost", "modelzoo"}


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


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_layout_and_version(package):
    """Each member has its own version, changelog entry for it, README, src, tests, benchmarks."""
    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    changelog = (package / "CHANGELOG.md").read_text()
    assert f"## {meta['version']}" in changelog, "CHANGELOG.md lacks the current version"
    for part in ("README.md", "tests", "benchmarks"):
        assert (package / part).exists(), part
    assert (package / "src" / meta["name"].replace("-", "_") / "__init__.py").exists()


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_imports_only_declared_siblings(package):
    """A package's source imports no workspace sibling it does not declare as a dependency."""
    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    own = meta["name"].replace("-", "_")
    # An optional extra counts as declared: the package must then import it lazily and guarded.
    extras = meta.get("optional-dependencies", {}).values()
    requirements = [*meta["dependencies"], *(dep for extra in extras for dep in extra)]
    declared = {re.split(r"[\s\[<>=~!;]", dep)[0].replace("-", "_") for dep in requirements}
    for source in (package / "src").rglob("*.py"):
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", source.read_text(), re.M))
        undeclared = (imported & WORKSPACE_IMPORTS) - declared - {own}
        assert not undeclared, f"{source.relative_to(ROOT)} imports {undeclared}"


def test_no_module_imports_torch_npu_at_top_level():
    """torch_npu is optional: only npu_core._npu may import it, and only lazily."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.glob("packages/*/src/**/*.py")
        if re.search(r"^(import torch_npu|from torch_npu)", path.read_text(), re.M)
    ]
    assert offenders == []


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_member_imports_beside_the_others(package):
    """With all members installed in one environment, each one's top-level module imports."""
    meta = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    module = importlib.import_module(meta["name"].replace("-", "_"))
    assert module.__name__ == meta["name"].replace("-", "_")
