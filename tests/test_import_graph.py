"""The workspace's import graph: no cycle at any depth, no private name taken from another module.

Every ``import`` statement counts, wherever it stands: at module level, inside a function (the
usual way to hide a cycle from the interpreter), or under ``if TYPE_CHECKING``. A cycle between
modules means neither can be understood, tested or moved without the other; a private name
(``from pkg.mod import _helper``) or another package's private module (``npu_core._x``) taken
from outside is an interface nobody promised to keep.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ImportGraph:
    """Modules of some source folders and the edges their import statements make."""

    files: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[str] = field(default_factory=list)

    @classmethod
    def scan(cls, sources: list[Path]) -> ImportGraph:
        files: dict[str, Path] = {}
        for src in sources:
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                files[".".join(parts)] = path
        graph = cls(files)
        for module, path in files.items():
            graph.edges[module] = set()
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                graph._add(module, package, node)
        return graph

    def _resolve(self, name: str) -> str | None:
        """The workspace module that importing ``name`` runs (its longest known prefix)."""
        while name and name not in self.files:
            name = name.rpartition(".")[0]
        return name or None

    def _add(self, module: str, package: str, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*kept, base] if base else kept)
            targets = []
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in self.files:
                    targets.append(full)
                    continue
                targets.append(base)
                if alias.name.startswith("_") and self._resolve(base) is not None:
                    self.private.append(f"{module} imports private name {alias.name} from {base}")
        else:
            return
        for name in targets:
            target = self._resolve(name)
            if target is None or target == module:
                continue
            self.edges[module].add(target)
            private_part = any(
                p.startswith("_") and not p.startswith("__") for p in name.split(".")
            )
            if private_part and name.split(".")[0] != module.split(".")[0]:
                self.private.append(f"{module} imports another package's private module {name}")

    def cycles(self) -> list[list[str]]:
        """Strongly connected components of more than one module (Tarjan, iterative)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        for root in self.edges:
            if root in index:
                continue
            work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(self.edges[root])))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                node, successors = work[-1]
                advanced = False
                for nxt in successors:
                    if nxt not in index:
                        index[nxt] = low[nxt] = len(index)
                        stack.append(nxt)
                        on_stack.add(nxt)
                        work.append((nxt, iter(sorted(self.edges[nxt]))))
                        advanced = True
                        break
                    if nxt in on_stack:
                        low[node] = min(low[node], index[nxt])
                if advanced:
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
        return found


WORKSPACE = ImportGraph.scan(sorted(ROOT.glob("packages/*/src")))


def test_workspace_source_has_no_import_cycle():
    """No two modules of any package reach each other through imports, function-level included."""
    assert WORKSPACE.cycles() == []


def test_no_module_imports_a_private_name_of_another_module():
    """Private names stay in their module; private modules stay in their package."""
    assert WORKSPACE.private == []


def test_scan_sees_every_package():
    """The scan covers every member's modules (a wrong glob would make the tests above vacuous)."""
    tops = {module.split(".")[0] for module in WORKSPACE.files}
    assert tops == {
        "npu_core",
        "mccl",
        "hyperparallel",
        "mfusion",
        "liteboost",
        "torchmind_modelzoo",
    }


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "toy").mkdir(parents=True)
    (src / "other").mkdir()
    (src / "toy" / "__init__.py").write_text("")
    (src / "other" / "__init__.py").write_text("")
    (src / "other" / "_hidden.py").write_text("VALUE = 1\n")
    return src


def test_a_function_level_import_closes_a_cycle(toy: Path):
    """A cycle hidden in a function body is still found."""
    (toy / "toy" / "a.py").write_text("from toy.b import g\n\ndef f():\n    return g()\n")
    (toy / "toy" / "b.py").write_text("def g():\n    from toy import a\n    return a\n")
    assert ImportGraph.scan([toy]).cycles() == [["toy.a", "toy.b"]]


def test_private_names_and_foreign_private_modules_are_reported(toy: Path):
    """``from mod import _name`` and ``import other._hidden`` from outside are both reported."""
    (toy / "toy" / "a.py").write_text("def _helper():\n    return 1\n")
    (toy / "toy" / "b.py").write_text(
        "from toy.a import _helper\nfrom other._hidden import VALUE\n"
    )
    assert ImportGraph.scan([toy]).private == [
        "toy.b imports private name _helper from toy.a",
        "toy.b imports another package's private module other._hidden",
    ]
