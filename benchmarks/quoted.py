"""The measured numbers the docs quote: tables each benchmark wrote beside its recorded run.

A benchmark writes its numbers to ``benchmarks/results/<run>.json`` and its tables beside
them, ``benchmarks/results/<run>.md``: each table between ``<!-- table: NAME -->`` and
``<!-- /table -->``, the first of them ``versions`` (software, devices, date). Recording
a run copies both into ``benchmarks/quoted/``. A page of the README or docs/ quotes a
recorded table between ``<!-- quoted: RUN.NAME -->`` and ``<!-- /quoted -->``; the prose
around it points at the table instead of restating its numbers, so a new run changes the
tables and nothing else:

    python -m benchmarks sweep                    # writes benchmarks/results/sweep.json, .md
    python -m benchmarks.quoted record sweep      # the run the docs quote from now on
    python -m benchmarks.quoted                   # rewrites every quoted region
    python -m benchmarks.quoted retable sweep     # the recorded run's tables, re-made by
                                                  # the benchmark's code (after a change)

On a GPU or TPU a benchmark's run is ``<name>_gpu`` or ``<name>_tpu`` (``sweep_gpu``),
recorded and quoted the same way beside the CPU run.

``tests/first_hour.py`` writes ``benchmarks/results/first_hour.json`` and ``.md`` the same
way. ``tests/test_docs.py`` checks that every quoted region equals its recorded table.
Results in ``benchmarks/results/`` stay untracked; a recorded run is tracked.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDED = Path(__file__).resolve().parent / "quoted"
RESULTS = Path(__file__).resolve().parent / "results"

REGION = re.compile(r"(<!-- quoted: (\w+)\.(\w+) -->)(.*?)(<!-- /quoted -->)", re.DOTALL)
"""A quoted region: its opening marker, the run, the table, the text, the closing marker."""

TABLE = re.compile(r"<!-- table: (\w+) -->\n(.*?)\n<!-- /table -->", re.DOTALL)
"""One table of a run's tables file: its name and its text."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A markdown table; ``align`` has an ``l`` or ``r`` per column (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if side == "l" else "---:" for side in align]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def versions(env: Mapping[str, Any], *, devices: bool = True) -> str:
    """``Python 3.11.7, jax 0.10.2, flax 0.12.8, optax 0.2.8; 8 CPU devices; recorded
    2026-11-28``: a benchmark run's software, devices (or only the platform, where each
    case names its own) and date."""
    software = f"Python {env['python']}, jax {env['jax']}, flax {env['flax']}"
    where = env["platform"].upper()
    if devices:
        where = f"{env['devices']} {where} device{'s' if env['devices'] != 1 else ''}"
    if env["platform"] != "cpu" and env.get("device_kind"):
        where += f" ({env['device_kind']})"
    return f"{software}, optax {env['optax']}; {where}; recorded {env['date']}"


def tables_text(run: str, tables: Mapping[str, str]) -> str:
    """The tables file of ``run``: a title, then each table between its markers."""
    parts = [f"# The tables of one `{run}` run (the docs quote them as `{run}.NAME`)"]
    parts += [f"<!-- table: {name} -->\n{text}\n<!-- /table -->" for name, text in tables.items()]
    return "\n\n".join(parts) + "\n"


Tables = Callable[[dict[str, Any]], dict[str, str]]
"""A benchmark's ``tables``: its markdown tables, by name, made from its run's JSON."""


def write_tables(folder: Path, run: str, results: dict[str, Any], tables: Tables) -> Path:
    """Writes ``<folder>/<run>.md``: the ``versions`` line of ``results`` (unless the
    benchmark makes its own) and its ``tables``."""
    made = tables(results)
    if "versions" not in made:
        made = {"versions": versions(results["environment"]), **made}
    folder.mkdir(exist_ok=True)
    path = folder / f"{run}.md"
    path.write_text(tables_text(run, made))
    print(f"wrote {path}")
    return path


def _retable(run: str) -> None:
    """Re-makes the tables of the recorded run ``run`` from its JSON with its benchmark's
    ``tables`` (in a process of its own: a benchmark chooses its devices on import)."""
    benchmark = run.removesuffix("_gpu").removesuffix("_tpu")  # an accelerator's run
    name = "tests.first_hour" if run == "first_hour" else f"benchmarks.{benchmark}"
    results = json.loads((RECORDED / f"{run}.json").read_text())
    write_tables(RECORDED, run, results, importlib.import_module(name).tables)


def recorded_tables(run: str) -> dict[str, str]:
    """The tables of the recorded run ``benchmarks/quoted/<run>.md``, by name."""
    path = RECORDED / f"{run}.md"
    if not path.exists():
        recorded = sorted(p.stem for p in RECORDED.glob("*.md"))
        raise KeyError(f"no recorded run {run!r}; the recorded runs are {recorded}")
    return dict(TABLE.findall(path.read_text()))


def render(run: str, name: str) -> str:
    """Table ``name`` of the recorded run ``run``."""
    tables = recorded_tables(run)
    if name not in tables:
        raise KeyError(f"the recorded run {run!r} has no table {name!r}: it has {sorted(tables)}")
    return tables[name]


def rendered(text: str) -> str:
    """``text`` with every quoted region replaced by its recorded table (a block region
    keeps its markers on lines of their own, an inline one stays inline)."""

    def one(match: re.Match[str]) -> str:
        opening, run, name, body, closing = match.groups()
        new = render(run, name)
        if body.startswith("\n"):
            new = f"\n{new}\n"
        return f"{opening}{new}{closing}"

    return REGION.sub(one, text)


def quoting_files() -> list[Path]:
    """README.md and every docs page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        RECORDED.mkdir(exist_ok=True)
        for run in argv[1:]:
            for suffix in (".json", ".md"):
                shutil.copyfile(RESULTS / f"{run}{suffix}", RECORDED / f"{run}{suffix}")
            print(f"recorded benchmarks/results/{run}.json and .md in benchmarks/quoted/")
        argv = []
    if argv[:1] == ["_retable"]:
        _retable(argv[1])
        return 0
    if argv[:1] == ["retable"]:
        for run in argv[1:]:
            subprocess.run([sys.executable, "-m", "benchmarks.quoted", "_retable", run], check=True)
        argv = []
    if argv:
        print(
            "usage: python -m benchmarks.quoted [record RUN ... | retable RUN ...]", file=sys.stderr
        )
        return 2
    for path in quoting_files():
        text = path.read_text()
        new = rendered(text)
        if new != text:
            path.write_text(new)
            print(f"rewrote the quoted regions of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
