"""Masked sums and counts reduced inside jit: the arithmetic of exact evaluation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PerExampleFn = Callable[[Any, Mapping[str, jax.Array]], Mapping[str, jax.Array]]
"""``fn(state, batch) -> {"metric": per-example values of shape [batch]}``."""

Totals = dict[str, jax.Array]


def masked_sums(values: Mapping[str, jax.Array], mask: jax.Array) -> Totals:
    """Sums of each per-example value over the real rows, and their ``count``.

    Masking uses ``where``, not multiplication: a NaN computed on a padded row would
    survive ``x * 0``.

    Examples:
        >>> import jax.numpy as jnp
        >>> sums = masked_sums({"loss": jnp.array([1.0, 3.0, jnp.nan])},
        ...                    jnp.array([True, True, False]))
        >>> float(sums["loss"]), int(sums["count"])
        (4.0, 2)
    """
    sums = {
        name: jnp.sum(jnp.where(mask, value, 0).astype(jnp.float32))
        for name, value in values.items()
    }
    sums["count"] = jnp.sum(mask.astype(jnp.int32))
    return sums


def zero_totals(
    per_example_fn: PerExampleFn,
    state: Any,
    batch: Mapping[str, jax.Array],
    mesh: Mesh,
    collect: Sequence[str] = (),
) -> Totals:
    """Replicated zeros for every metric ``per_example_fn`` returns (shapes from ``eval_shape``)."""
    names = [name for name in jax.eval_shape(per_example_fn, state, batch) if name not in collect]
    zeros: dict[str, np.ndarray] = {name: np.zeros((), np.float32) for name in names}
    zeros["count"] = np.zeros((), np.int32)
    return jax.device_put(zeros, NamedSharding(mesh, PartitionSpec()))
