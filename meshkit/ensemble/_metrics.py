"""Per-member metric names: ``member_<i>/<name>`` scalars, and reading them back as arrays."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

_MEMBER_KEY = re.compile(r"^member_(\d+)/(.+)$")


def member_metric_name(index: int, name: str) -> str:
    """The key under which member ``index``'s metric ``name`` is reported.

    Examples:
        >>> member_metric_name(3, "accuracy")
        'member_3/accuracy'
    """
    return f"member_{index}/{name}"


def flatten_member_metrics(metrics_K: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """``{"loss": [K] values}`` -> ``{"member_0/loss": scalar, ...}`` (one scalar per member).

    Scalars are what ``meshkit.train.fit`` logs and checks, so per-member metrics travel
    as one named scalar each.
    """
    return {
        member_metric_name(index, name): values[index]
        for name, values in metrics_K.items()
        for index in range(values.shape[0])
    }


def per_member(metrics: Mapping[str, Any], name: str) -> np.ndarray:
    """Member ``0..K-1``'s values of metric ``name``, as one host array of length K.

    Reads the ``member_<i>/<name>`` entries of a train step's metrics, of an
    evaluation's ``metrics`` (``meshkit.evaluate.full_eval`` with ``ensemble_metrics``),
    or of ``FitResult.train_metrics`` / ``eval_metrics``.

    Examples:
        >>> per_member({"member_1/loss": 0.5, "member_0/loss": 0.25, "loss": 0.375}, "loss")
        array([0.25, 0.5 ])
    """
    found: dict[int, Any] = {}
    for key, value in metrics.items():
        match = _MEMBER_KEY.match(key)
        if match and match.group(2) == name:
            found[int(match.group(1))] = value
    if not found:
        names = sorted({m.group(2) for m in map(_MEMBER_KEY.match, metrics) if m})
        raise KeyError(
            f"No per-member metric {name!r}: the member metrics are {names}, keyed "
            "'member_<i>/<name>'."
        )
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"Metric {name!r} is missing for members {missing}.")
    return np.asarray([np.asarray(found[index]) for index in range(len(found))])
