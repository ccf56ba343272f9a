"""Masked sums and counts reduced inside jit: the arithmetic of exact evaluation."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshkit._host import replicated_sharding
from meshkit._types import PerExampleFn

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


class _Unhashed:
    """A cache argument left out of the key: every instance compares equal."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unhashed)


def zero_totals(
    per_example_fn: PerExampleFn,
    state: Any,
    batch: Mapping[str, jax.Array],
    mesh: Mesh,
    collect: Sequence[str] = (),
) -> Totals:
    """Replicated zeros for every metric ``per_example_fn`` returns (names from ``eval_shape``).

    The names are traced once per function and input signature, not once per call, so
    repeated evaluations (``fit`` evaluates every ``eval_every`` steps) pay no tracing.
    """
    signature = tuple(_signature(tree) for tree in (state, batch))
    names = _metric_names(per_example_fn, tuple(collect), signature, _Unhashed((state, batch)))
    zeros: dict[str, np.ndarray] = {name: np.zeros((), np.float32) for name in names}
    zeros["count"] = np.zeros((), np.int32)
    return jax.device_put(zeros, replicated_sharding(mesh))


def _signature(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return (
        treedef,
        *((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves),
    )


@functools.lru_cache(maxsize=64)
def _metric_names(
    per_example_fn: PerExampleFn,
    collect: tuple[str, ...],
    signature: tuple[Any, ...],
    inputs: _Unhashed,
) -> tuple[str, ...]:
    """The metric names ``per_example_fn`` returns for inputs of this ``signature``."""
    del signature  # the cache key
    state, batch = inputs.value
    return tuple(
        name for name in jax.eval_shape(per_example_fn, state, batch) if name not in collect
    )
