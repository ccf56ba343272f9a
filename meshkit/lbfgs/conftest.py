"""Doctest set-up: the method examples of ``LBFGS`` continue from its class example."""

from __future__ import annotations

import doctest
from typing import Any

import pytest

from meshkit.lbfgs import LBFGS


def class_example(cls: type) -> dict[str, Any]:
    """The names the examples in ``cls``'s docstring define, after running them."""
    namespace: dict[str, Any] = {}
    for example in doctest.DocTestParser().get_examples(cls.__doc__ or ""):
        exec(compile(example.source, f"<{cls.__name__} example>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="session", autouse=True)
def lbfgs_class_example(doctest_namespace: dict[str, Any]) -> None:
    doctest_namespace.update(class_example(LBFGS))
