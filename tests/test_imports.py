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


ENVIRONMENT_AFTER_IMPORT = """
import json, os
import jax  # JAX's own import may set variables of its own (libtpu's, where installed)
before = dict(os.environ)
def changed():
    return sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k))
import meshkit, meshkit.data, meshkit.train, meshkit.ensemble, meshkit.sweep
library = changed()
import meshkit.plan
print(json.dumps([library, changed()]))
"""


def run_python(code: str, **env: str) -> str:
    """``code``'s standard output in a fresh interpreter, with ``env`` added to (or, for
    an empty value, taken from) the environment."""
    import os
    import subprocess
    import sys

    environ = {**os.environ, **env}
    environ = {name: value for name, value in environ.items() if value}
    command = [sys.executable, "-c", code]
    done = subprocess.run(
        command, capture_output=True, text=True, env=environ, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.once
def test_importing_meshkit_changes_no_environment_variable():
    import json

    from meshkit.plan._environment import COMPILE_ONLY_ENVIRONMENT

    library, planning = json.loads(run_python(ENVIRONMENT_AFTER_IMPORT).splitlines()[-1])
    assert library == []
    # the planner's own, and only where libtpu or the CUDA plugin is installed
    assert set(planning) <= {*COMPILE_ONLY_ENVIRONMENT, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"}


CPU_ONLY = """
import jax
from meshkit import _plugins, distributed
_plugins.libtpu_installed = lambda: True  # as if meshkit[tpu] were installed
_plugins.has_tpu_devices = lambda: False  # on a machine without TPUs
print(_plugins.cpu_only_without_accelerators(), jax.config.jax_platforms)
distributed.initialize()
print(jax.devices()[0].platform)
"""


@pytest.mark.once
def test_initialize_starts_jax_on_the_cpu_where_the_plugins_have_no_chips():
    """libtpu without TPUs (or the CUDA plugin without GPUs) would fail at length as JAX
    starts; initialize starts on the CPU without asking them, and keeps a choice made."""
    assert run_python(CPU_ONLY, JAX_PLATFORMS="").split() == ["True", "cpu", "cpu"]
    assert run_python(CPU_ONLY, JAX_PLATFORMS="cpu").split() == ["False", "cpu", "cpu"]
    neither = "_plugins.cuda_plugin_installed = lambda: False\nprint("
    plain = CPU_ONLY.replace("lambda: True", "lambda: False").replace("print(", neither, 1)
    # neither plugin: JAX chooses as it would
    assert run_python(plain, JAX_PLATFORMS="").split()[:2] == ["False", "None"]
