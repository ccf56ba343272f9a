"""Hooks: code of yours that ``fit`` calls at its boundaries, with the host metrics.

A hook is ``hook(boundary) -> bool | None``; returning ``True`` asks ``fit`` to stop:
it saves a checkpoint at the next step and returns with ``stopped_early=True``.
Hooks run on every process with the same values (the metrics are read from
replicated arrays), so a hook that decides from them alone decides the same
everywhere; one that reads anything else (a clock, a file) must make every process
agree, or the processes stop at different steps and the others wait forever.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

BoundaryKind = Literal["log", "eval", "checkpoint"]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Where ``fit`` is, for a hook.

    Attributes:
      kind: ``"log"`` (a training record: the interval's metric means with
        ``learning_rate``, ``steps_per_second``...), ``"eval"`` (an evaluation's
        metrics, ``count`` and the means, without the ``eval/`` prefix) or
        ``"checkpoint"`` (a save was started; no metrics).
      step: the step the boundary follows.
      metrics: the values, as written to ``metrics.jsonl``.
    """

    kind: BoundaryKind
    step: int
    metrics: Mapping[str, Any]


Hook = Callable[[Boundary], bool | None]
"""``hook(boundary) -> bool | None``: ``True`` stops training after saving."""


class EarlyStopping:
    """A hook that stops training when a metric has not improved for ``patience`` checks.

    Args:
      metric: the name to watch, e.g. ``"accuracy"`` at ``"eval"`` boundaries.
      kind: the boundaries to watch it at.
      mode: ``"max"`` (higher is better) or ``"min"``.
      patience: checks without an improvement of more than ``min_delta`` before stopping.
      min_delta: the least change that counts as an improvement.

    The count starts with each ``fit`` call: a resumed run watches afresh.

    Examples:
        >>> stop = EarlyStopping("accuracy", patience=2)
        >>> [stop(Boundary("eval", s, {"accuracy": a})) for s, a in
        ...  [(1, 0.5), (2, 0.7), (3, 0.69), (4, 0.7)]]
        [False, False, False, True]
    """

    def __init__(
        self,
        metric: str,
        *,
        kind: BoundaryKind = "eval",
        mode: Literal["max", "min"] = "max",
        patience: int = 3,
        min_delta: float = 0.0,
    ):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}.")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}.")
        self.metric = metric
        self.kind = kind
        self.sign = 1.0 if mode == "max" else -1.0
        self.patience = patience
        self.min_delta = min_delta
        self.best = -math.inf
        self.checks_without_improvement = 0

    def __call__(self, boundary: Boundary) -> bool:
        if boundary.kind != self.kind:
            return False
        if self.metric not in boundary.metrics:
            raise KeyError(
                f"EarlyStopping watches {self.metric!r} at {self.kind!r} boundaries, but "
                f"step {boundary.step} reports only {sorted(boundary.metrics)}."
            )
        value = self.sign * float(boundary.metrics[self.metric])
        if value > self.best + self.min_delta:
            self.best = value
            self.checks_without_improvement = 0
            return False
        self.checks_without_improvement += 1
        return self.checks_without_improvement >= self.patience
