"""Every ```python block in the docs runs, on its own, in a fresh interpreter.

A reader copies one block into a new Python session, on a machine with one device. So
each block runs in a fresh process with JAX's defaults: it imports what it uses, and
a block that needs several devices says so itself (``jax_num_cpu_devices``). A block
that builds on the one before it says so on its first line (``# Continues the block
above``) and runs after the blocks it continues, in the same process: a page's blocks
fall into chains, each a block that stands alone and the continuations after it.
Shell commands are ```bash blocks and output is ```text; neither runs.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the pages are the same in every pass: check them once

DOCS = Path(__file__).resolve().parent.parent / "docs"

# An opening fence (possibly indented, e.g. inside an admonition), its language, the
# body, and the closing fence.
FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL
)

RUN = "python"
NOT_RUN = frozenset({"bash", "text", "yaml", "toml"})

PAGES = sorted(DOCS.rglob("*.md"))


def fenced_blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, body)`` for each fenced block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [
        (match[1], text.count("\n", 0, match.start()) + 1, textwrap.dedent(match[2]))
        for match in FENCE.finditer(text)
    ]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    return [(line, body) for language, line, body in fenced_blocks(page) if language == RUN]


def page_id(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


RUNNABLE = [page for page in PAGES if python_blocks(page)]


def test_the_guide_pages_have_python_blocks():
    assert {"index.md", "concepts.md", "pmap.md"} <= {page_id(page) for page in RUNNABLE}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_names_a_known_language(page: Path):
    unknown = [
        f"line {line}: {language or '(none)'}"
        for language, line, _ in fenced_blocks(page)
        if language != RUN and language not in NOT_RUN
    ]
    assert not unknown, (
        f"{page_id(page)} has fenced blocks that neither run nor are marked as not run: "
        f"{unknown}. Use ```python for code that must run, or one of {sorted(NOT_RUN)}."
    )


CONTINUES = re.compile(r"# Continues the blocks? above\b")
"""The first line of a block that uses names an earlier block of its page defined."""

RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for page, line, body in json.loads(sys.stdin.read()):
    exec(compile("\\n" * line + body, page, "exec"), namespace)
"""
"""Runs a chain's blocks in order in one namespace; tracebacks give the Markdown lines."""


def chains(page: Path) -> list[list[tuple[int, str]]]:
    """The page's blocks grouped into chains: one that stands alone, then its continuations."""
    grouped: list[list[tuple[int, str]]] = []
    for line, body in python_blocks(page):
        if CONTINUES.match(body):
            assert grouped, f"{page_id(page)}:{line} continues a block, but none comes before it"
            grouped[-1].append((line, body))
        else:
            grouped.append([(line, body)])
    return grouped


CHAINS = [
    pytest.param(page, chain, id=f"{page_id(page)}:{chain[0][0]}")
    for page in RUNNABLE
    for chain in chains(page)
]


@pytest.mark.once(8)  # a fresh process of its own, whatever the pass: in the lighter one
@pytest.mark.parametrize(("page", "chain"), CHAINS)
def test_each_block_runs_in_a_fresh_interpreter(page: Path, chain: list[tuple[int, str]]):
    import json
    import os
    import subprocess
    import sys

    blocks = [(str(page), line, body) for line, body in chain]
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=DOCS.parent,  # where a reader runs the docs' commands: the repository's root
        env=environment,
    )
    assert out.returncode == 0, (
        f"{page_id(page)}, the block at line {chain[0][0]}"
        + (f" and its {len(chain) - 1} continuations" if len(chain) > 1 else "")
        + f", failed in a fresh interpreter:\n{out.stderr[-3000:]}"
    )
    assert "will be removed in meshkit" not in out.stderr, out.stderr  # docs use today's API


def test_readme_quickstart_runs_in_a_fresh_process():
    """The README's quickstart starts with initialize(), so it needs a process of its own."""
    import subprocess
    import sys

    readme = DOCS.parent / "README.md"
    blocks = [body for language, _, body in fenced_blocks(readme) if language == RUN]
    assert len(blocks) == 1
    out = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "64.0"
    assert "w     (64, 512)  float32" in out.stdout


def test_quoted_measurements_are_the_recorded_runs():
    """Every ``<!-- quoted: RUN.NAME -->`` region of the README and the docs equals table
    NAME of the recorded run (``python -m benchmarks.quoted`` rewrites them), and every
    table a recorded run holds is quoted somewhere."""
    from benchmarks import quoted

    stale = []
    names = set()
    for path in quoted.quoting_files():
        text = path.read_text()
        names |= {f"{match[2]}.{match[3]}" for match in quoted.REGION.finditer(text)}
        if quoted.rendered(text) != text:
            stale.append(str(path.relative_to(quoted.ROOT)))
    assert not stale, (
        f"quoted measurements differ from the recorded runs in {stale}: run "
        "`python -m benchmarks.quoted` (and record a run in benchmarks/quoted/, never edit "
        "the numbers in the pages)"
    )
    recorded = {
        f"{path.stem}.{name}"
        for path in quoted.RECORDED.glob("*.md")
        for name in quoted.recorded_tables(path.stem)
    }
    assert recorded <= names, f"recorded tables no page quotes: {sorted(recorded - names)}"
