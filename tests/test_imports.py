"""The package graph: no module imports, even for type checking only, one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshkit

pytestmark = pytest.mark.once  # import structure

ROOT = Path(meshkit.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every meshkit module and the meshkit modules it names in an import statement."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` that pass through no package ``__init__`` (which re-exports)."""
    packages = {name for name in graph if (ROOT.parent / name.replace(".", "/")).is_dir()}
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node] - packages):
            if nxt in path:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(set(graph) - packages):
        visit(start, [start])
    return found


def test_the_graph_is_seen():
    graph = import_graph()
    assert "meshkit.lbfgs._programs" in graph["meshkit.lbfgs._solver"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, relative imports resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _formats_imports(path: Path) -> set[str]:
    """The imports in ``path`` that reach the formats, directly or through the face."""
    return {
        name
        for name in _imported_modules(path)
        if name == "meshkit.data" or name.startswith("meshkit.data._formats")
    }


@pytest.mark.once
def test_the_data_core_imports_no_format():
    # The core (meshkit/data/_*.py) and the image operations read any Source; the
    # formats import them, never the reverse, even inside a function.
    data = ROOT / "data"
    core = sorted([*data.glob("_*.py"), *(data / "image").glob("*.py")])
    core = [path for path in core if path.name != "__init__.py" or path.parent != data]
    assert {path.stem for path in data.glob("_*.py")} >= {"_source", "_pipeline", "_feed"}
    reached = {_module_name(path): _formats_imports(path) for path in core}
    assert not any(reached.values()), {name: sorted(t) for name, t in reached.items() if t}
    formats = data / "_formats" / "_image_records.py"
    # The check sees relative imports and imports inside functions.
    assert {"meshkit.data._formats._encoded", "meshkit.data"} <= _formats_imports(formats)
