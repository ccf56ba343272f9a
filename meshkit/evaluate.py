"""Full evaluation: every example exactly once, fixed shapes, masked sums reduced inside jit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshkit._host import to_host
from meshkit.data import EvalPipeline, GlobalBatchIterator

PerExampleFn = Callable[[Any, Mapping[str, jax.Array]], Mapping[str, jax.Array]]
"""``fn(state, batch) -> {"metric": per-example values of shape [batch]}``."""

Totals = dict[str, jax.Array]
EvalStep = Callable[[Any, Mapping[str, jax.Array], Totals], Totals]


def masked_sums(values: Mapping[str, jax.Array], mask: jax.Array) -> Totals:
    """Sums of each per-example value over the real rows, and their count.

    Masking uses ``where``, not multiplication: a NaN computed on a padded row would
    survive ``x * 0``.
    """
    sums = {
        name: jnp.sum(jnp.where(mask, value, 0).astype(jnp.float32))
        for name, value in values.items()
    }
    sums["count"] = jnp.sum(mask.astype(jnp.int32))
    return sums


def make_eval_step(
    per_example_fn: PerExampleFn, state_shardings: Any, batch_sharding: NamedSharding
) -> EvalStep:
    """A jitted ``step(state, batch, totals) -> totals`` that adds one batch's masked sums.

    The batch must carry ``mask`` (from ``EvalPipeline``). The running totals stay on
    the devices; only the final totals are read.
    """
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())

    def eval_step(state: Any, batch: Mapping[str, jax.Array], totals: Totals) -> Totals:
        sums = masked_sums(per_example_fn(state, batch), batch["mask"])
        return {name: totals[name] + sums[name] for name in sums}

    return jax.jit(
        eval_step,
        in_shardings=(state_shardings, batch_sharding, replicated),
        out_shardings=replicated,
    )


def _zero_totals(
    per_example_fn: PerExampleFn, state: Any, batch: Mapping[str, jax.Array], mesh: Any
) -> Totals:
    shapes = jax.eval_shape(per_example_fn, state, batch)
    replicated = NamedSharding(mesh, PartitionSpec())
    zeros = {name: jnp.zeros((), jnp.float32) for name in shapes}
    zeros["count"] = jnp.zeros((), jnp.int32)
    return jax.device_put(zeros, replicated)


def run_eval(
    eval_step: EvalStep, per_example_fn: PerExampleFn, state: Any, pipeline: EvalPipeline
) -> dict[str, float]:
    """Runs ``eval_step`` over every batch of ``pipeline``; returns the metric means and count.

    At most one step is in flight (the previous step's totals are awaited after each
    dispatch). The count is checked against the pipeline's example count.
    """
    totals: Totals | None = None
    pending: Totals | None = None
    with GlobalBatchIterator(pipeline) as batches:
        for batch in batches:
            if totals is None:
                totals = _zero_totals(per_example_fn, state, batch, pipeline.sharding.mesh)
            totals = eval_step(state, batch, totals)
            if pending is not None:  # at most one step in flight
                jax.block_until_ready(pending["count"])
            pending = totals
    if totals is None:
        return {"count": 0}
    host = to_host(totals)
    count = int(host.pop("count"))
    if count != pipeline.num_examples:
        raise RuntimeError(
            f"Evaluation counted {count} examples but the dataset has "
            f"{pipeline.num_examples}; the eval batches were not padded and masked as "
            "expected. Use meshkit.data.EvalPipeline."
        )
    return {"count": count, **{name: float(value) / count for name, value in host.items()}}
