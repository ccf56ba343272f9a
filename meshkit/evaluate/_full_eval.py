"""``full_eval``: exact metrics (and per-example outputs) over a finite dataset."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshkit._batch import batch_sharding
from meshkit._host import replicated_sharding, to_host
from meshkit._inflight import InFlight, default_max_in_flight
from meshkit._mesh import DATA_AXIS, check_data_axis
from meshkit._types import PerExampleFn
from meshkit.data import ArraySource, EvalPipeline, GlobalBatchIterator
from meshkit.evaluate._steps import (
    Totals,
    check_per_example,
    finish_metrics,
    masked_sums,
    per_example_values,
    zero_totals,
)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What ``full_eval`` measured.

    Attributes:
      metrics: the mean of each per-example value over the real examples.
      count: how many real examples were evaluated (always the dataset's size).
      per_example: the values named in ``collect``, one row per example, in the
        dataset's order (padding removed).
      num_steps: eval steps run (``ceil(count / global_batch_size)``).
    """

    metrics: dict[str, float]
    count: int
    per_example: dict[str, np.ndarray]
    num_steps: int


def _eval_body(per_example_fn: PerExampleFn, collect: tuple[str, ...]) -> Any:
    """``(state, batch, totals) -> (totals, kept)``: one batch's masked sums added.

    Every value ``per_example_fn`` returns, collected or averaged, is checked to have
    the batch's leading dimension while the step is traced (once per compile).
    """

    def eval_step(state: Any, batch: Mapping[str, jax.Array], totals: Totals) -> Any:
        values = per_example_values(per_example_fn, state, batch)  # in its logical rules
        what = "full_eval's per_example_fn returned"
        kept = {name: values.pop(name) for name in collect}
        check_per_example(kept, batch["mask"].shape[0], what=what)  # the rest: masked_sums
        sums = masked_sums(values, batch["mask"], what=what)
        return {name: totals[name] + sums[name] for name in sums}, kept

    return eval_step


@functools.lru_cache(maxsize=32)
def _eval_step(per_example_fn: PerExampleFn, collect: tuple[str, ...], mesh: Mesh) -> Any:
    """One jitted step per (function, collected names, mesh): compiled once per batch shape."""
    replicated = replicated_sharding(mesh)
    return jax.jit(_eval_body(per_example_fn, collect), out_shardings=(replicated, None))


@functools.lru_cache(maxsize=32)
def _resident_eval_step(
    per_example_fn: PerExampleFn,
    collect: tuple[str, ...],
    sharding: NamedSharding,
    num_examples: int,
) -> Any:
    """The step over resident batches: ``(state, batches, k, totals) -> (k + 1, totals,
    kept, index)``. Batch ``k`` is a slice every device takes of its own rows; its mask
    and indices are computed there, as the host pipeline writes them."""
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    replicated = replicated_sharding(mesh)
    body = _eval_body(per_example_fn, collect)

    def resident_eval_step(
        state: Any, batches: Mapping[str, jax.Array], k: jax.Array, totals: Totals
    ) -> Any:
        batch = {key: _batch(value, k, sharding) for key, value in batches.items()}
        rows = next(iter(batches.values())).shape[1]
        positions = k * rows + jnp.arange(rows, dtype=jnp.int32)
        mask = positions < num_examples
        batch["mask"] = jax.lax.with_sharding_constraint(mask, sharding)
        batch["index"] = jax.lax.with_sharding_constraint(jnp.where(mask, positions, -1), sharding)
        new_totals, kept = body(state, batch, totals)
        return k + 1, new_totals, kept, batch["index"]

    return jax.jit(resident_eval_step, out_shardings=(replicated, replicated, None, None))


def _batch(batches: jax.Array, k: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Batch ``k`` of ``[steps, rows, ...]`` resident batches, rows split as ``sharding``."""
    batch = jax.lax.dynamic_index_in_dim(batches, k, axis=0, keepdims=False)
    return jax.lax.with_sharding_constraint(batch, sharding)


def _as_pipeline(
    data: EvalPipeline | Mapping[str, np.ndarray],
    mesh: Mesh | None,
    batch_size: int | None,
    data_axis: str,
) -> EvalPipeline:
    if isinstance(data, EvalPipeline):
        if mesh is not None or batch_size is not None or data_axis != DATA_AXIS:
            raise ValueError(
                "full_eval takes mesh, batch_size and data_axis only for in-memory arrays; "
                f"got mesh={mesh!r}, batch_size={batch_size!r}, data_axis={data_axis!r} with "
                "an EvalPipeline, which already has its sharding and global batch size. "
                "Drop them, or set them on the EvalPipeline."
            )
        return data
    if mesh is None or batch_size is None:
        raise ValueError(
            "full_eval on in-memory arrays needs mesh= and batch_size= (the global batch "
            f"size, a multiple of the data axis); got mesh={mesh!r}, batch_size={batch_size!r}."
        )
    mesh = check_data_axis(mesh, data_axis, where="full_eval")
    sharding = batch_sharding(mesh, data_axis)
    return EvalPipeline(ArraySource(data), global_batch_size=batch_size, sharding=sharding)


def full_eval(
    per_example_fn: PerExampleFn,
    state: Any,
    data: EvalPipeline | Mapping[str, np.ndarray],
    *,
    mesh: Mesh | None = None,
    batch_size: int | None = None,
    collect: Sequence[str] = (),
    data_axis: str = DATA_AXIS,
) -> EvalResult:
    """Evaluates ``per_example_fn`` on every example exactly once.

    The data is padded to whole global batches with a mask, so the step keeps one
    shape and compiles once for any dataset size, the last partial batch included.
    Every process runs the same number of steps, known up front from the example
    count, with no host synchronisation per step (a bounded number of steps queued:
    ``default_max_in_flight``). Metrics are masked sums and counts reduced inside jit
    (``where``-masked, so a NaN computed on a padded row cannot leak) and divided once
    at the end; the count is checked against the dataset's size.

    Args:
      per_example_fn: ``fn(state, batch) -> {"name": values of shape [batch]}``. The
        batch holds the data fields plus ``mask`` and ``index``. Every value needs the
        batch's leading dimension (checked when the step is traced): a batch-level
        value such as a mean would average the padded rows in, so it is an error.
      state: passed to ``per_example_fn`` (e.g. a train state or parameters).
      data: an ``EvalPipeline``, or a dict of in-memory arrays with ``mesh`` and
        ``batch_size`` (global) given.
      mesh: the mesh, for in-memory arrays (the batch is split over ``data_axis``).
      batch_size: the global batch size, for in-memory arrays.
      collect: names of per-example values to return in dataset order (e.g.
        predictions) instead of averaging them.
      data_axis: the mesh axis the rows are split over, for in-memory arrays (an
        ``EvalPipeline`` has its own sharding).

    Returns:
      An ``EvalResult``.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, meshkit
        >>> from meshkit.evaluate import full_eval
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> def per_example(w, batch):
        ...     pred = batch["x"] * w
        ...     return {"error": jnp.abs(pred - batch["y"]), "pred": pred}
        >>> arrays = {"x": np.arange(10.0), "y": 2 * np.arange(10.0)}
        >>> result = full_eval(per_example, 2.0, arrays, mesh=mesh, batch_size=8,
        ...                    collect=["pred"])
        >>> result.count, result.metrics["error"], result.per_example["pred"][-3:].tolist()
        (10, 0.0, [14.0, 16.0, 18.0])
    """
    pipeline = _as_pipeline(data, mesh, batch_size, data_axis)
    collect = tuple(collect)
    pipeline_mesh = pipeline.sharding.mesh
    assert isinstance(pipeline_mesh, Mesh)
    step = _eval_step(per_example_fn, collect, pipeline_mesh)
    window: InFlight[tuple[jax.Array, Mapping[str, jax.Array]]] = InFlight(
        default_max_in_flight(pipeline_mesh)
    )
    totals: Totals | None = None
    parts: dict[str, list[np.ndarray]] = {name: [] for name in collect}
    indices: list[np.ndarray] = []

    def keep(index: jax.Array, kept: Mapping[str, jax.Array]) -> None:
        host_index = to_host(index)
        real = host_index >= 0
        indices.append(host_index[real])
        for name, value in to_host(dict(kept)).items():
            parts[name].append(value[real])

    if pipeline.resident:
        totals = _resident_passes(
            per_example_fn, state, pipeline, collect, window=window, keep=keep
        )
    else:
        with GlobalBatchIterator(pipeline) as batches:
            for batch in batches:
                if totals is None:
                    totals = zero_totals(per_example_fn, state, batch, pipeline_mesh, collect)
                new_totals, kept = step(state, batch, totals)
                totals = new_totals
                for done in window.push((batch["index"], kept), new_totals["count"]):
                    if collect:
                        keep(*done)
    for done in window.drain():
        if collect:
            keep(*done)
    return _result(totals, pipeline, collect, indices, parts)


def _resident_passes(
    per_example_fn: PerExampleFn,
    state: Any,
    pipeline: EvalPipeline,
    collect: tuple[str, ...],
    *,
    window: InFlight[tuple[jax.Array, Mapping[str, jax.Array]]],
    keep: Callable[[jax.Array, Mapping[str, jax.Array]], None],
) -> Totals:
    """The steps over resident batches: each dispatch sends nothing but the state."""
    batches = pipeline.resident_batches
    sharding = pipeline.sharding
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    example = {
        key: jax.ShapeDtypeStruct(value.shape[1:], value.dtype) for key, value in batches.items()
    }
    rows = pipeline.global_batch_size
    example["mask"] = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    example["index"] = jax.ShapeDtypeStruct((rows,), jnp.int32)
    totals = zero_totals(per_example_fn, state, example, mesh, collect)
    step = _resident_eval_step(per_example_fn, collect, sharding, pipeline.num_examples)
    k = jax.device_put(np.zeros((), np.int32), replicated_sharding(mesh))
    for _ in range(pipeline.num_steps or 0):
        k, totals, kept, index = step(state, batches, k, totals)
        for done in window.push((index, kept), totals["count"]):
            if collect:
                keep(*done)
    return totals


def _result(
    totals: Totals | None,
    pipeline: EvalPipeline,
    collect: tuple[str, ...],
    indices: list[np.ndarray],
    parts: dict[str, list[np.ndarray]],
) -> EvalResult:
    if totals is None:
        empty = {name: np.zeros((0,)) for name in collect}
        return EvalResult(metrics={}, count=0, per_example=empty, num_steps=0)
    host = to_host(totals)
    count = int(host.pop("count"))
    if count != pipeline.num_examples:
        raise RuntimeError(
            f"Evaluation counted {count} examples but the dataset has {pipeline.num_examples}; "
            "the batches were not padded and masked as expected."
        )
    per_example = {}
    if collect:
        order = np.argsort(np.concatenate(indices), kind="stable")
        per_example = {name: np.concatenate(parts[name])[order] for name in collect}
    metrics = finish_metrics(host, count)
    return EvalResult(metrics, count, per_example, pipeline.num_steps or 0)
