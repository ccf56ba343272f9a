"""One seam for Orbax: only ``meshkit.checkpoint._orbax`` imports it; one function reads
its privates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshkit
from meshkit.checkpoint import _orbax

pytestmark = pytest.mark.once  # source structure

ROOT = Path(meshkit.__file__).parent
ADAPTER = Path(_orbax.__file__)
PRIVATE_READ = "_unfinished_writes"  # the adapter's one function that reads Orbax's privates


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}


def orbax_imports(tree: ast.Module) -> list[str]:
    """The modules named ``orbax...`` that ``tree`` imports, by statement or by string."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args:  # import_module / __import__
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in ("import_module", "__import__"):
                    names.append(first.value)
    return [name for name in names if name == "orbax" or name.startswith("orbax.")]


def private_reads(tree: ast.Module) -> list[tuple[str, str, int]]:
    """``(function, name, line)`` for each private name read off an object other than ``self``.

    Both ``obj._name`` and ``getattr(obj, "_name", ...)`` count; ``function`` is the
    innermost enclosing function (``""`` at module level).
    """
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        own = isinstance(node, ast.Attribute) and getattr(node.value, "id", "") in ("self", "cls")
        if isinstance(node, ast.Attribute) and _private(node.attr) and not own:
            found.append((function, node.attr, node.lineno))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append((function, node.args[1].value, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return found


def test_only_the_adapter_imports_orbax():
    importers = {
        str(path.relative_to(ROOT.parent)): names
        for path, tree in _sources().items()
        if (names := orbax_imports(tree))
    }
    assert importers == {"meshkit/checkpoint/_orbax.py": ["orbax.checkpoint"]}, (
        "Orbax is reached through meshkit/checkpoint/_orbax.py only: move what touches it there."
    )


def test_no_orbax_import_names_a_private_module():
    for path, tree in _sources().items():
        for name in orbax_imports(tree):
            assert not any(_private(part) for part in name.split(".")), (path, name)


def test_the_adapter_reads_orbax_privates_in_one_named_function_only():
    reads = private_reads(ast.parse(ADAPTER.read_text()))
    assert reads, "the scan sees the adapter's private reads"  # the test still looks
    outside = [read for read in reads if read[0] != PRIVATE_READ]
    assert outside == [], f"private Orbax reads outside {PRIVATE_READ}: {outside}"
    assert callable(getattr(_orbax, PRIVATE_READ))


def test_the_scan_finds_private_reads_and_imports():
    source = ast.parse(
        "import orbax.checkpoint as ocp\n"
        "import importlib\n"
        "def f(manager):\n"
        "    return manager._checkpointer, getattr(manager, '_x'), self._own, x.__name__\n"
        "m = importlib.import_module('orbax.checkpoint._src')\n"
    )
    assert private_reads(source) == [("f", "_checkpointer", 4), ("f", "_x", 4)]
    assert orbax_imports(source) == ["orbax.checkpoint", "orbax.checkpoint._src"]


def _own_private_attributes(tree: ast.Module) -> set[str]:
    """The private names the adapter sets on its own objects (``self._manager``)."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and _private(node.attr)
    }


def test_no_other_module_reaches_orbax_through_the_adapter_s_privates():
    """Outside the adapter no module names Orbax, so an Orbax object could only be reached
    through the adapter's own private attributes (``Storage._manager``): none reads them."""
    held = _own_private_attributes(ast.parse(ADAPTER.read_text()))
    assert "_manager" in held  # the scan sees where the adapter keeps Orbax's manager
    reads = [
        (str(path.relative_to(ROOT.parent)), function, name, line)
        for path, tree in _sources().items()
        if path != ADAPTER
        for function, name, line in private_reads(tree)
        if name in held
    ]
    assert reads == []
