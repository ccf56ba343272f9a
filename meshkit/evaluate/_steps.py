"""Masked sums and counts reduced inside jit: the arithmetic of exact evaluation."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshkit._host import replicated_sharding
from meshkit._pytree import signature as pytree_signature
from meshkit._types import PerExampleFn

Totals = dict[str, jax.Array]


def per_example_values(
    per_example_fn: PerExampleFn, state: Any, batch: Mapping[str, jax.Array]
) -> dict[str, Any]:
    """``per_example_fn(state, batch)`` inside the state's activation rules, if it has any.

    A train state created with a logical table (``PartitionRules(logical=...)``)
    carries it with its mesh; while an evaluation step traces, the table then resolves
    ``nn.with_logical_constraint`` in the model as the train step does, whether
    ``per_example_fn`` goes through ``apply_model`` or calls ``state.apply_fn``
    itself. Any other state (parameters, ``None``) runs the function as it is.

    Examples:
        >>> import numpy as np
        >>> per_example_values(lambda _, b: {"x": b["x"] * 2}, None, {"x": np.arange(3)})
        {'x': array([0, 2, 4])}
    """
    scope = getattr(state, "logical_scope", None)  # a TrainState's; other states have none
    context = contextlib.nullcontext() if scope is None else scope()
    with cast(contextlib.AbstractContextManager[Any], context):
        return dict(per_example_fn(state, batch))


def check_per_example(values: Mapping[str, Any], rows: int, *, what: str) -> None:
    """Raises unless every value has ``rows`` as its leading dimension: one value per example.

    Shapes are static, so inside a jitted step this runs once, while it is traced. A
    scalar here is usually a mean over the batch, which would average the padded rows
    in with the real ones.

    Args:
      values: the per-example values, by name.
      rows: the batch's leading dimension (padded rows included).
      what: who got the values, for the message (``"full_eval's per_example_fn returned"``).

    Raises:
      ValueError: a value is a scalar or has another leading dimension; the message
        names it, its shape, the expected leading size and the fix.

    Examples:
        >>> import numpy as np
        >>> check_per_example({"loss": np.zeros(4)}, 4, what="example got")
        >>> mean = {"loss": np.float32(0)}
        >>> check_per_example(mean, 4, what="example got")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: example got 'loss' with shape (), but per-example values need the ...
    """
    for name, value in values.items():
        shape = tuple(np.shape(value))
        if not shape or shape[0] != rows:
            raise ValueError(
                f"{what} {name!r} with shape {shape}, but per-example values need the "
                f"batch's leading dimension, {rows} (padded rows included); a batch-level "
                "value would average the padding in with the real rows. Return one value "
                "per example, e.g. a vector of shape (batch,), not its mean."
            )


def masked_sums(
    values: Mapping[str, jax.Array], mask: jax.Array, *, what: str = "masked_sums got"
) -> Totals:
    """Sums of each per-example value over the real rows, and their ``count``.

    Every value needs the mask's leading dimension (``check_per_example``; ``what``
    names the values' source in its message); a value with more dimensions is summed
    over them too. Masking uses ``where``, not
    multiplication: a NaN computed on a padded row would survive ``x * 0``.

    Examples:
        >>> import jax.numpy as jnp
        >>> sums = masked_sums({"loss": jnp.array([1.0, 3.0, jnp.nan])},
        ...                    jnp.array([True, True, False]))
        >>> float(sums["loss"]), int(sums["count"])
        (4.0, 2)
    """
    check_per_example(values, mask.shape[0], what=what)
    sums = {
        name: jnp.sum(jnp.where(_rows_mask(mask, value), value, 0).astype(jnp.float32))
        for name, value in values.items()
    }
    for name, value in values.items():  # real rows with a NaN or an infinity, by name
        if jnp.issubdtype(value.dtype, jnp.inexact):
            bad = ~jnp.isfinite(value).reshape(value.shape[0], -1).all(axis=1)
            sums[NONFINITE + name] = jnp.sum(bad & mask).astype(jnp.float32)
    sums["count"] = jnp.sum(mask.astype(jnp.int32))
    return sums


NONFINITE = "nonfinite/"
"""Totals (and result metrics, where not 0) counting the real examples whose value of a
metric was NaN or infinite: ``nonfinite/loss``."""


def finish_metrics(host: dict[str, Any], count: int) -> dict[str, Any]:
    """The metric means of host totals (``count`` popped), with each ``nonfinite/``
    count kept as a count where it is not 0, and a warning naming it."""
    metrics: dict[str, Any] = {}
    for name, value in host.items():
        if not name.startswith(NONFINITE):
            metrics[name] = float(value) / count
        elif value:
            metrics[name] = int(value)
    bad = {name[len(NONFINITE) :]: metrics[name] for name in metrics if name.startswith(NONFINITE)}
    if bad:
        listed = ", ".join(f"{number} gave a non-finite {name}" for name, number in bad.items())
        warnings.warn(
            f"Evaluation: of {count} examples, {listed} (NaN or infinity), so those means "
            "are not finite; the counts are in the metrics as "
            f"{sorted(NONFINITE + name for name in bad)}. Check those examples' inputs (a "
            "NaN pixel, an empty text) and the model's numerics.",
            stacklevel=3,
        )
    return metrics


def _rows_mask(mask: jax.Array, value: jax.Array) -> jax.Array:
    """``mask`` shaped to mask whole rows of ``value`` (``where`` aligns trailing axes)."""
    return mask.reshape(mask.shape + (1,) * (jnp.ndim(value) - 1))


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
    batch: Mapping[str, Any],
    mesh: Mesh,
    collect: Sequence[str] = (),
) -> Totals:
    """Replicated zeros for every metric ``per_example_fn`` returns (names from ``eval_shape``).

    The names are traced once per function and input signature, not once per call, so
    repeated evaluations (``fit`` evaluates every ``eval_every`` steps) pay no tracing.
    """
    signature = tuple(pytree_signature(tree) for tree in (state, batch))
    names = _metric_names(per_example_fn, tuple(collect), signature, _Unhashed((state, batch)))
    zeros: dict[str, np.ndarray] = {name: np.zeros((), np.float32) for name in names}
    zeros["count"] = np.zeros((), np.int32)
    return jax.device_put(zeros, replicated_sharding(mesh))


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
    values = jax.eval_shape(functools.partial(per_example_values, per_example_fn), state, batch)
    names = tuple(name for name in values if name not in collect)
    inexact = tuple(
        NONFINITE + name for name in names if jnp.issubdtype(values[name].dtype, jnp.inexact)
    )
    return names + inexact
