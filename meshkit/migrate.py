"""Finds pmap-era code: ``python -m meshkit.migrate PATH...`` lists each idiom and its replacement.

The files (Python, and Jupyter notebooks cell by cell) are parsed, never run. Each
finding names the file and line, the idiom, what replaces it in meshkit and the section
of the pmap guide (docs/pmap.md) that shows it.
The exit code is 1 when anything was found, so the check can run in a project's CI; a
line ending in ``# meshkit: ok`` is not reported (a model kept and wrapped in
``per_device``, for instance), and ``--json`` prints the findings as JSON.

Examples:
    >>> source = '''
    ... import jax
    ... from flax import jax_utils
    ... state = jax_utils.replicate(state)
    ... step = jax.pmap(train_step, axis_name="batch")
    ... '''
    >>> for finding in scan_source(source, "train.py"):
    ...     print(finding.line, finding.idiom)
    4 flax.jax_utils.replicate
    5 jax.pmap
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

GUIDE = "docs/pmap.md#what-replaces-what"

# full dotted name -> what replaces it
CALLS: dict[str, str] = {
    "jax.pmap": "jax.jit with shardings on a mesh from meshkit.make_mesh('data=-1')",
    "jax.lax.pmean": "nothing inside a jit over sharded data (a mean over the global array); "
    "jax.shard_map where per-device code is really wanted",
    "jax.lax.psum": "a jnp.sum over the global array inside the jit; jax.shard_map for "
    "per-device code",
    "jax.lax.axis_index": "rarely needed; jax.lax.axis_index('data') inside jax.shard_map",
    "jax.lax.ppermute": "jax.shard_map over the mesh axis with jax.lax.ppermute inside: "
    "per-device communication stays per-device code",
    "jax.lax.all_to_all": "jax.shard_map over the mesh axis with jax.lax.all_to_all inside, "
    "or a reshard of the global array (jax.lax.with_sharding_constraint)",
    "jax.lax.all_gather": "nothing inside a jit: the global array is already whole; "
    "jax.shard_map where per-device code is really wanted",
    "jax.device_put_sharded": "meshkit.shard_batch(batch, meshkit.batch_sharding(mesh))",
    "jax.device_put_replicated": "meshkit.replicate(tree, mesh)",
    "flax.jax_utils.replicate": "meshkit.replicate(tree, mesh), or create the state under "
    "jit with out_shardings (meshkit.train.create_train_state)",
    "flax.jax_utils.unreplicate": "meshkit.to_host(tree), or keep the global array",
    "flax.jax_utils.prefetch_to_device": "nothing: fit's GlobalBatchIterator places batches "
    "ahead of their steps",
    "flax.jax_utils.pad_shard_unpad": "meshkit.evaluate.full_eval (or "
    "meshkit.evaluate.pad_shard_unpad)",
    "flax.training.common_utils.shard": "meshkit.shard_batch(batch, sharding): no leading "
    "device axis",
    "flax.training.common_utils.shard_prng_key": "nothing: one key; state.step_rng() per step",
    "flax.training.common_utils.get_metrics": "fit's logged interval means, or "
    "meshkit.to_host(metrics)",
    "flax.training.checkpoints.save_checkpoint": "fit's Checkpoints(every=...) or "
    "meshkit.checkpoint.Checkpointer",
    "flax.training.checkpoints.save_checkpoint_multiprocess": "fit's Checkpoints(every=...) "
    "or meshkit.checkpoint.Checkpointer: every process writes its own shards of the global arrays",
    "flax.training.checkpoints.restore_checkpoint": "fit resumes from its workdir; "
    "meshkit.train.import_flax_checkpoint(dir, state) reads the old program's checkpoints",
    "flax.training.dynamic_scale.DynamicScale": "create_train_state(..., precision='f16'): a "
    "dynamic loss scale in the state",
    "jax.local_device_count": "the global batch size: TrainPipeline(global_batch_size=...) "
    "and shard_batch split it; no reshape to (devices, per_device, ...)",
}
CALL_NAMES: dict[str, str] = {  # calls of these names, wherever they are defined
    "sync_batch_stats": "nothing: batch_stats is one global array in state.collections",
    "cross_replica_mean": "nothing: values under jit are global arrays",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One pmap-era idiom in a file.

    Attributes:
      path: the file.
      line: its line number (in its cell, for a notebook).
      idiom: what was found (a dotted name, or a description).
      replacement: what replaces it in meshkit.
      cell: for a Jupyter notebook, the cell, counting every cell from 1.
    """

    path: str
    line: int
    idiom: str
    replacement: str
    cell: int | None = None

    def __str__(self) -> str:
        where = f"cell {self.cell}:{self.line}" if self.cell is not None else self.line
        return f"{self.path}:{where}: {self.idiom}: {self.replacement} ({GUIDE})"


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from the module's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, imports: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = imports.get(node.id, node.id)
    return ".".join([root, *reversed(parts)])


def _is_device_count(node: ast.expr, imports: dict[str, str]) -> bool:
    """``jax.device_count()``, ``jax.local_device_count()`` or ``len(jax.devices())``."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func, imports)
    if name == "len" and len(node.args) == 1 and isinstance(node.args[0], ast.Call):
        return _dotted(node.args[0].func, imports) in ("jax.devices", "jax.local_devices")
    return name in ("jax.device_count", "jax.local_device_count")


def _counts_devices(node: ast.AST, imports: dict[str, str]) -> bool:
    """Whether a device count appears anywhere in ``node``."""
    return any(
        isinstance(sub, ast.expr) and _is_device_count(sub, imports) for sub in ast.walk(node)
    )


def _is_first_item_lambda(node: ast.expr) -> bool:
    """``lambda x: x[0]``: what an unreplicate written by hand maps over a state."""
    if not isinstance(node, ast.Lambda) or len(node.args.args) != 1:
        return False
    body, name = node.body, node.args.args[0].arg
    return (
        isinstance(body, ast.Subscript)
        and isinstance(body.value, ast.Name)
        and body.value.id == name
        and isinstance(body.slice, ast.Constant)
        and body.slice.value == 0
    )


TREE_MAPS = ("jax.tree_util.tree_map", "jax.tree.map", "jax.tree_map")


class _Finder:
    """The idioms in a tree. Each check returns whether to look inside its node; the
    walk keeps its own stack, so a chain of hundreds of ``+`` (generated code, such as
    sympy's lookup tables) is checked like any other expression."""

    def __init__(self, path: str, imports: dict[str, str], cell: int | None = None):
        self.path = path
        self.imports = imports
        self.cell = cell
        self.findings: list[Finding] = []

    def visit(self, tree: ast.AST) -> None:
        checks: dict[type, Callable[[Any], bool]] = {
            ast.Attribute: self._name,
            ast.Name: self._name,
            ast.Call: self._call,
            ast.BinOp: self._arithmetic,
            ast.ClassDef: self._class,
        }
        stack = [tree]
        while stack:
            node = stack.pop()
            check = checks.get(type(node))
            if check is None or check(node):
                stack.extend(ast.iter_child_nodes(node))

    def add(self, node: ast.AST, idiom: str, replacement: str) -> None:
        line = getattr(node, "lineno", 0)
        self.findings.append(Finding(self.path, line, idiom, replacement, self.cell))

    def _name(self, node: ast.Attribute | ast.Name) -> bool:
        name = _dotted(node, self.imports)
        if name in CALLS:
            self.add(node, name, CALLS[name])
            return False
        return True

    def _call(self, node: ast.Call) -> bool:
        name = _dotted(node.func, self.imports) or ""
        short = name.split(".")[-1]
        if short in CALL_NAMES:
            self.add(node, short, CALL_NAMES[short])
        target = short
        if name in ("functools.partial", "partial") and node.args:  # partial(nn.BatchNorm, ...)
            target = (_dotted(node.args[0], self.imports) or "").split(".")[-1]
        if target == "BatchNorm" and any(k.arg == "axis_name" for k in node.keywords):
            self.add(
                node,
                "BatchNorm(axis_name=...)",
                "drop axis_name: under jit the batch statistics are already global (or keep "
                "the model and wrap it: meshkit.train.per_device(model, mesh, axis_name=...))",
            )
        self._call_patterns(node, name, short)
        return True

    def _call_patterns(self, node: ast.Call, name: str, short: str) -> None:
        """The idioms written with ordinary calls: by their shape, not their name."""
        if name in TREE_MAPS and node.args and _is_first_item_lambda(node.args[0]):
            self.add(
                node,
                "an unreplicate by hand (tree_map(lambda x: x[0], ...))",
                "nothing: the state is one global array per leaf (meshkit.to_host for numpy)",
            )
        if short == "value_and_grad" and any(k.arg == "axis_name" for k in node.keywords):
            self.add(
                node,
                "DynamicScale.value_and_grad(axis_name=...)",
                "create_train_state(..., precision='f16') and make_train_step: the loss scale "
                "is in the state, the gradients are global, no axis name",
            )
        if name in ("jax.numpy.where", "numpy.where") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in ("is_fin", "is_finite"):
                self.add(
                    node,
                    "keeping a step only where its gradients are finite (jnp.where(is_fin, ...))",
                    "nothing: make_train_step skips a float16 step whose gradients overflowed",
                )
        if short == "reshape" and _counts_devices(node, self.imports):
            self.add(
                node,
                "a reshape to (devices, per_device, ...)",
                "nothing: a global batch under jit, split by its sharding "
                "(meshkit.shard_batch, TrainPipeline(global_batch_size=...))",
            )

    def _arithmetic(self, node: ast.BinOp) -> bool:
        divisor = node.right
        if (
            isinstance(node.op, (ast.FloorDiv, ast.Div))
            and isinstance(divisor, ast.Call)
            and _dotted(divisor.func, self.imports) == "jax.process_count"
        ):
            self.add(
                node,
                "a per-process batch size (... // jax.process_count())",
                "the global batch size: TrainPipeline(global_batch_size=...) gives each "
                "process its rows (meshkit.data_shard says which)",
            )
            return False
        if isinstance(node.op, ast.Mult) and (
            _is_device_count(node.left, self.imports) or _is_device_count(node.right, self.imports)
        ):
            self.add(
                node,
                "a value scaled by the device count",
                "scale by the global batch size instead (it stays the same when devices change)",
            )
            return False
        return True

    def _class(self, node: ast.ClassDef) -> bool:
        bases = [(_dotted(base, self.imports) or "").split(".")[-1] for base in node.bases]
        fields = [
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        ]
        if "TrainState" in bases and "batch_stats" in fields:
            self.add(
                node,
                "a TrainState subclass with batch_stats",
                "meshkit.train.TrainState: batch_stats live in state.collections",
            )
        return True


def scan_source(source: str | bytes, path: str = "<source>") -> list[Finding]:
    """Every pmap-era idiom in Python ``source``, in line order."""
    tree = ast.parse(source, filename=path)
    text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
    return _scan(tree, text, path, _imports(tree))


def _scan(
    tree: ast.Module, text: str, path: str, imports: dict[str, str], cell: int | None = None
) -> list[Finding]:
    """The findings of one parsed module (or notebook cell), less the handled lines."""
    finder = _Finder(path, imports, cell)
    finder.visit(tree)
    handled = {
        number
        for number, line in enumerate(text.splitlines(), 1)
        if line.rstrip().endswith(HANDLED)
    }
    unique = {(f.line, f.idiom): f for f in finder.findings if f.line not in handled}
    return sorted(unique.values(), key=lambda f: (f.line, f.idiom))


class NotANotebookError(ValueError):
    """A ``.ipynb`` file that is not a Jupyter notebook's JSON."""


def scan_notebook(
    source: str | bytes, path: str = "<notebook>", *, unreadable: list[str] | None = None
) -> list[Finding]:
    """Every pmap-era idiom in the code cells of a Jupyter notebook (its ``.ipynb`` JSON),
    by cell (counting every cell from 1) and line in the cell.

    Imports count across cells (a notebook imports in its first cell what later cells
    use); IPython's ``%magic`` and ``!shell`` lines are skipped. A cell that is not
    valid Python is named in ``unreadable`` (raised as ``SyntaxError`` when it is
    ``None``) and the other cells are still checked.

    Examples:
        >>> cells = [{"cell_type": "code", "source": ["import jax\\n", "!nvidia-smi\\n"]},
        ...          {"cell_type": "markdown", "source": "Now `pmap` it."},
        ...          {"cell_type": "code", "source": "step = jax.pmap(train_step)"}]
        >>> [str(f).split(": ")[0] for f in scan_notebook(json.dumps({"cells": cells}), "nb.ipynb")]
        ['nb.ipynb:cell 3:1']
    """
    try:
        cells = json.loads(source)["cells"]
        code = [
            (number, _without_magics(_cell_text(cell)))
            for number, cell in enumerate(cells, 1)
            if cell.get("cell_type") == "code"
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise NotANotebookError(
            f"not a Jupyter notebook ({type(error).__name__}: {error})"
        ) from None
    parsed: list[tuple[int, str, ast.Module]] = []
    for number, text in code:
        try:
            parsed.append((number, text, ast.parse(text, filename=f"{path}, cell {number}")))
        except (SyntaxError, ValueError) as error:
            reason = f"{path}: cell {number} not checked, {_unreadable(error)}"
            if unreadable is None:
                raise SyntaxError(reason) from None
            unreadable.append(reason)
    imports: dict[str, str] = {}
    for _, _, tree in parsed:
        imports.update(_imports(tree))
    return [
        finding
        for number, text, tree in parsed
        for finding in _scan(tree, text, path, imports, cell=number)
    ]


def _cell_text(cell: dict[str, object]) -> str:
    source = cell.get("source", "")
    if isinstance(source, list):
        return "".join(str(line) for line in source)
    if not isinstance(source, str):
        raise TypeError(f"a cell's source is {type(source).__name__}, not text")
    return source


def _without_magics(text: str) -> str:
    """The cell with IPython's ``%``/``%%`` magic and ``!`` shell lines as ``pass``
    (line numbers kept)."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            lines[index] = line[: len(line) - len(stripped)] + "pass"
    return "\n".join(lines)


HANDLED = "# meshkit: ok"
"""A line ending in this comment is not reported: its idiom was looked at and kept."""


SKIPPED_FOLDERS = (".venv", "site-packages", ".nox", ".tox", ".ipynb_checkpoints", ".git")
"""Folders a scan of a folder does not enter: installed packages (a virtual environment,
nox's and tox's), Jupyter's autosaves, git's. A folder named on the command line is
scanned whatever its name."""


def _python_files(paths: Sequence[str]) -> Iterator[Path]:
    """The files at ``paths``; a folder's Python files and notebooks, in name order."""
    for name in paths:
        path = Path(name)
        if path.is_dir():
            yield from sorted(
                p
                for pattern in ("*.py", "*.ipynb")
                for p in path.rglob(pattern)
                if not set(SKIPPED_FOLDERS) & set(p.relative_to(path).parts)
            )
        else:
            yield path


def scan_paths(
    paths: Sequence[str], *, unreadable: list[str] | None = None, progress: bool = False
) -> list[Finding]:
    """Every pmap-era idiom in the Python files at ``paths`` (files or folders).

    ``progress`` shows a bar of the files checked on standard error.

    A file that is not Python this checker can read (a binary, a text in an encoding
    its coding line does not declare, a syntax error) is skipped with one line in
    ``unreadable`` (raised as ``SyntaxError`` when it is ``None``); the others are
    still checked. Source bytes are decoded as Python does (PEP 263 coding lines).

    Raises:
      FileNotFoundError: a path does not exist.
    """
    findings: list[Finding] = []
    files = list(_python_files(paths))
    for path in tqdm(files, unit="file", leave=False, disable=not progress or len(files) < 2):
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder to check.")
        try:
            if path.suffix == ".ipynb":
                findings += scan_notebook(path.read_bytes(), str(path), unreadable=unreadable)
            else:
                findings += scan_source(path.read_bytes(), str(path))
        except (SyntaxError, ValueError, RecursionError) as error:  # ValueError: null bytes
            reason = f"{path}: not checked, {_unreadable(error)}"
            if unreadable is None:
                raise SyntaxError(reason) from None
            unreadable.append(reason)
    return findings


def _unreadable(error: Exception) -> str:
    """Why a file could not be read as Python, in a few words."""
    if isinstance(error, NotANotebookError):
        return str(error)
    if isinstance(error, RecursionError):  # thousands of terms in one expression
        return "an expression nested too deeply for Python's own parser to build its tree"
    message = getattr(error, "msg", None) or str(error)
    line = getattr(error, "lineno", None)
    where = f" at line {line}" if line else ""
    return f"not valid Python{where}: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m meshkit.migrate PATH...``: prints the findings; 1 if any, else 0."""
    parser = argparse.ArgumentParser(
        prog="python -m meshkit.migrate",
        description="List the pmap-era idioms in Python files and Jupyter notebooks and what "
        "replaces each.",
    )
    parser.add_argument("paths", nargs="+", help="Python files, notebooks (.ipynb) or folders")
    parser.add_argument(
        "--json", action="store_true", help="print the findings as a JSON list of objects"
    )
    args = parser.parse_args(argv)
    folders = [name for name in args.paths if Path(name).is_dir()]
    if folders and not any(True for _ in _python_files(folders)):
        print(
            f"error: no Python files (*.py) or notebooks (*.ipynb) in {', '.join(folders)}.",
            file=sys.stderr,
        )
        return 2
    unreadable: list[str] = []
    try:
        findings = scan_paths(args.paths, unreadable=unreadable, progress=sys.stderr.isatty())
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        records = [{**dataclasses.asdict(f), "guide": GUIDE} for f in findings]
        print(json.dumps({"findings": records, "not_checked": unreadable}, indent=1))
        return 1 if findings else 2 if unreadable else 0
    for finding in findings:
        print(finding)
    for reason in unreadable:
        print(reason, file=sys.stderr)
    files = len({f.path for f in findings})
    summary = f"{len(findings)} pmap-era idiom(s) in {files} file(s)" if findings else "none found"
    skipped = f"; {len(unreadable)} file(s) not checked (above)" if unreadable else ""
    print(summary + skipped + ("." if findings else ""))
    return 1 if findings else 2 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
