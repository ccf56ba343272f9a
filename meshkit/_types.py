"""The types that train, evaluate and ensemble share: a batch, metrics, a per-example function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

Batch = Mapping[str, jax.Array]
"""A global batch: named ``jax.Array`` fields whose leading (row) dimension is split
over the data axis, e.g. ``{"image": [rows, 28, 28, 1], "label": [rows]}``."""

Metrics = dict[str, jax.Array]
"""Named scalar metrics of one step, e.g. ``{"loss": ..., "accuracy": ...}``, on the device."""

PerExampleFn = Callable[[Any, Batch], Mapping[str, jax.Array]]
"""``fn(state, batch) -> {"name": values of shape [rows]}``: one value per example.

``state`` is whatever the caller evaluates (a ``meshkit.train.TrainState``, an
ensemble's stacked state, bare parameters). The batch holds the data fields, plus
``mask`` (``True`` on real rows) and ``index`` when ``meshkit.evaluate`` pads it;
the values on padded rows are masked out, so they need not be finite.
"""
