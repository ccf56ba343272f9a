"""Doctest set-up for the package's docstrings (kept out of the installed package).

The method examples of ``meshkit.lbfgs.LBFGS`` continue from its class example: the
names that example defines are in their doctest namespace.
"""

from __future__ import annotations

import doctest
import functools
from pathlib import Path
from typing import Any

import pytest

LBFGS_MODULES = Path(__file__).parent / "meshkit" / "lbfgs"


@functools.cache
def _lbfgs_class_example() -> dict[str, Any]:
    from meshkit.lbfgs import LBFGS

    return class_example(LBFGS)


def class_example(cls: type) -> dict[str, Any]:
    """The names the examples in ``cls``'s docstring define, after running them."""
    namespace: dict[str, Any] = {}
    for example in doctest.DocTestParser().get_examples(cls.__doc__ or ""):
        exec(compile(example.source, f"<{cls.__name__} example>", "exec"), namespace)
    return namespace


@pytest.fixture(autouse=True)
def lbfgs_class_example(request: pytest.FixtureRequest) -> None:
    """Adds the ``LBFGS`` class example's names to the doctests of ``meshkit/lbfgs``."""
    if not isinstance(request.node, pytest.DoctestItem):
        return
    if LBFGS_MODULES not in Path(str(request.node.path)).parents:
        return
    request.getfixturevalue("doctest_namespace").update(_lbfgs_class_example())
