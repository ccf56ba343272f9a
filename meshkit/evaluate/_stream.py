"""``stream_eval``: evaluation when no one knows the dataset's length up front."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshkit._batch import batch_sharding, pad_rows, row_blocks, shard_batch
from meshkit._host import replicated_sharding, to_host
from meshkit._mesh import DATA_AXIS, check_data_axis
from meshkit._pytree import leading_rows
from meshkit._types import PerExampleFn
from meshkit.data import Record
from meshkit.evaluate._full_eval import EvalResult
from meshkit.evaluate._steps import (
    Totals,
    finish_metrics,
    masked_sums,
    per_example_values,
    zero_totals,
)


@functools.lru_cache(maxsize=32)
def _stream_step(per_example_fn: PerExampleFn, mesh: Mesh) -> Any:
    replicated = replicated_sharding(mesh)

    def step(state: Any, batch: Mapping[str, jax.Array], totals: Totals) -> Any:
        values = per_example_values(per_example_fn, state, batch)  # in its logical rules
        what = "stream_eval's per_example_fn returned"
        sums = masked_sums(values, batch["mask"], what=what)
        more = jnp.any(batch["more"])  # does any process hold another batch?
        return {name: totals[name] + sums[name] for name in sums}, more

    return jax.jit(step, out_shardings=(replicated, replicated))


def _pad_local(batch: Record | None, template: Record, rows: int, more: bool) -> Record:
    if batch is None:
        batch = {key: value[:0] for key, value in template.items()}
    count = leading_rows(batch, what="stream_eval")
    if count > rows:
        raise ValueError(
            f"stream_eval got a local batch of {count} rows; rows_per_process is {rows}. "
            "Batch the local data to at most rows_per_process rows."
        )
    padded, mask = pad_rows(batch, rows)
    return {**padded, "mask": mask, "more": np.full(rows, more)}


def stream_eval(
    per_example_fn: PerExampleFn,
    state: Any,
    local_batches: Iterable[Record],
    *,
    mesh: Mesh,
    rows_per_process: int,
    template: Record | None = None,
    data_axis: str = DATA_AXIS,
) -> EvalResult:
    """Evaluates data of unknown length, e.g. a filtered dataset, exactly once per example.

    Each process iterates its own ``local_batches`` (at most ``rows_per_process`` rows
    each; processes may hold different numbers of examples). Short and missing batches
    are padded with a mask. Each step also reduces, inside the jitted step, whether any
    process holds a further batch; the host reads that flag one step late, while the
    next step runs, so there is no extra blocking collective per step and all
    processes stop at the same step. The cost is at most one extra, all-padding step.

    Args:
      per_example_fn: ``fn(state, batch) -> {"name": values of shape [batch]}``; a
        value without the batch's leading dimension is an error, as in ``full_eval``.
      state: passed to ``per_example_fn``.
      local_batches: this process's batches (dicts of arrays with a leading row axis).
      mesh: the mesh; batches go over its ``data_axis`` axis.
      rows_per_process: rows each process contributes per step.
      template: one record batch giving field shapes and dtypes, needed only by a
        process that may have no data at all.
      data_axis: the mesh axis the rows are split over.

    Returns:
      An ``EvalResult`` with the metric means and the count (``per_example`` is empty).

    Examples:
        >>> import jax.numpy as jnp, numpy as np, meshkit
        >>> from meshkit.evaluate import stream_eval
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> def odd_numbers():  # a filtered stream: its length is unknown up front
        ...     for start in range(0, 100, 10):
        ...         x = np.arange(start, start + 10)
        ...         yield {"x": x[x % 2 == 1]}
        >>> result = stream_eval(lambda _, b: {"x": b["x"]}, None, odd_numbers(),
        ...                      mesh=mesh, rows_per_process=8 * jax.local_device_count())
        >>> result.count, result.metrics["x"]
        (50, 50.0)
    """
    mesh = check_data_axis(mesh, data_axis, where="stream_eval")
    sharding = batch_sharding(mesh, data_axis)
    blocks = row_blocks(sharding)
    if rows_per_process % blocks.shards_per_block:
        raise ValueError(
            f"rows_per_process={rows_per_process} must be a multiple of the "
            f"{blocks.shards_per_block} data shards on each process."
        )
    global_rows = rows_per_process * blocks.count
    step_fn = _stream_step(per_example_fn, mesh)
    iterator = iter(local_batches)
    upcoming = next(iterator, None)
    template = template if template is not None else upcoming
    if template is None:
        raise ValueError(
            "This process has no data and no template: pass template= (one batch with "
            "the fields' shapes and dtypes) so it can send padding while others finish."
        )
    totals: Totals | None = None
    pending_more: jax.Array | None = None
    steps = 0
    while True:
        current, upcoming = upcoming, (next(iterator, None) if upcoming is not None else None)
        local = _pad_local(current, template, rows_per_process, upcoming is not None)
        batch = shard_batch(local, sharding, global_batch_size=global_rows)
        if totals is None:
            totals = zero_totals(per_example_fn, state, batch, mesh)
        totals, more = step_fn(state, batch, totals)
        steps += 1
        if pending_more is not None and not bool(pending_more):
            break  # no process had this step's batch: it was the one extra step
        pending_more = more
    host = to_host(totals)
    count = int(host.pop("count"))
    metrics = finish_metrics(host, count) if count else {}
    return EvalResult(metrics=metrics, count=count, per_example={}, num_steps=steps)
