"""Every ```python block in the docs runs.

The blocks of one page run in order, in one namespace (a fresh one per page), so a
page may build on its earlier blocks. Shell commands are ```bash blocks and output is
```text; neither runs. Blocks use only the devices that exist (``data=-1`` meshes or
``jax.device_count()`` guards); they run in the 8-device pass, where a block that
assumed one device would fail.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the pages' code, once: at 8 devices

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


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_blocks_run(page: Path):
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    for line, body in python_blocks(page):
        # Leading newlines make traceback line numbers those of the Markdown file.
        code = compile("\n" * line + body, str(page), "exec")
        exec(code, namespace)


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
