"""Step metrics: their layout in one float32 vector, and their sums kept on the device.

``MetricLayout`` packs a step's metrics into one vector (``fit``'s step program returns
one such row per step, summed into log lines on the host: ``LogLines``). For a loop of
one's own, ``MetricSums`` fuses a train step with running sums of those vectors on the
device (an ``Interval``, with a step count and the position of the first step whose
loss or gradient norm was not finite), read once per log interval: one small copy per
interval, equal to ``fit``'s log lines.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._host import replicated_sharding, to_host

WATCHED = ("loss", "grad_norm")
"""Metrics whose non-finite values stop training (each one the step reports)."""

StepFn = Callable[[Any, Any], tuple[Any, Mapping[str, jax.Array]]]


class Interval(NamedTuple):
    """Device-side totals of the steps since the last boundary (a pytree of 3 arrays).

    Attributes:
      sums: ``f32[size]``: every metric element, summed over the interval's steps.
      steps: ``i32[]``: steps in the interval.
      first_bad: ``i32[]``: 1-based position in the interval of the first step whose
        watched metrics were not all finite; 0 while every step was finite.
    """

    sums: jax.Array
    steps: jax.Array
    first_bad: jax.Array


@dataclasses.dataclass(frozen=True)
class MetricLayout:
    """Where each metric lives in the packed vector (known before the first step runs).

    Attributes:
      names: the metric names, sorted.
      shapes: each metric's shape (``()`` for the usual scalars).
      watched: the names among ``WATCHED`` that the step reports.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    watched: tuple[str, ...]

    @classmethod
    def of(cls, metrics: Mapping[str, Any]) -> MetricLayout:
        """The layout of a step's metrics (arrays or ``ShapeDtypeStruct``s)."""
        if not isinstance(metrics, Mapping):
            raise TypeError(
                "fit needs a train step returning (state, metrics) with metrics a dict of "
                f"arrays, got metrics of type {type(metrics).__name__}."
            )
        watched = tuple(name for name in WATCHED if name in metrics)
        if not watched:
            raise ValueError(
                f"The train step reports metrics {sorted(metrics)}, but fit watches "
                f"{list(WATCHED)} to stop on a non-finite value and reports none of them. "
                "Return the loss as metrics['loss'] (make_train_step does)."
            )
        names = tuple(sorted(metrics))
        return cls(names, tuple(tuple(metrics[name].shape) for name in names), watched)

    @property
    def size(self) -> int:
        """Elements in the packed vector."""
        return sum(math.prod(shape) for shape in self.shapes)

    def pack(self, metrics: Mapping[str, jax.Array]) -> jax.Array:
        """All metrics as one ``f32[size]`` vector (traced inside the step)."""
        return jnp.concatenate(
            [jnp.ravel(jnp.asarray(metrics[name], jnp.float32)) for name in self.names]
        )

    def finite(self, metrics: Mapping[str, jax.Array]) -> jax.Array:
        """Whether every watched metric is finite (a traced boolean)."""
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(metrics[n])) for n in self.watched]))

    def columns(self, name: str) -> np.ndarray:
        """The positions of metric ``name``'s elements in the packed vector."""
        index = self.names.index(name)
        start = sum(math.prod(shape) for shape in self.shapes[:index])
        return np.arange(start, start + math.prod(self.shapes[index]))

    def unpack(self, vector: np.ndarray) -> dict[str, Any]:
        """Host values by name: floats for scalars, nested lists otherwise."""
        values: dict[str, Any] = {}
        offset = 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            size = math.prod(shape)
            chunk = vector[offset : offset + size]
            values[name] = float(chunk[0]) if shape == () else chunk.reshape(shape).tolist()
            offset += size
        return values


def zero_interval(layout: MetricLayout, mesh: Mesh) -> Interval:
    """An empty ``Interval``, replicated on ``mesh``."""
    zeros = (np.zeros((layout.size,), np.float32), np.zeros((), np.int32), np.zeros((), np.int32))
    return Interval(*jax.device_put(zeros, replicated_sharding(mesh)))


def _add(layout: MetricLayout, interval: Interval, metrics: Mapping[str, jax.Array]) -> Interval:
    """``interval`` with one more step's ``metrics`` (traced)."""
    steps = interval.steps + 1
    newly_bad = (interval.first_bad == 0) & ~layout.finite(metrics)
    first_bad = jnp.where(newly_bad, steps, interval.first_bad)
    return Interval(interval.sums + layout.pack(metrics), steps, first_bad)


@functools.lru_cache(maxsize=16)
def interval_update(layout: MetricLayout, mesh: Mesh) -> Callable[[Interval, Any], Interval]:
    """A jitted ``update(interval, metrics) -> interval``, for steps that are not jitted.

    A train step written as plain Python (host logic between jitted calls) cannot run
    inside ``accumulating_step``; its metrics are added by this second small program.
    """
    replicated = replicated_sharding(mesh)
    return jax.jit(functools.partial(_add, layout), out_shardings=replicated)


def accumulating_step(
    train_step: StepFn,
    layout: MetricLayout,
    state_shardings: Any,
    mesh: Mesh,
    *,
    donate_state: bool,
) -> Callable[[Any, Any, Interval], tuple[Any, Interval]]:
    """``step(state, batch, interval) -> (state, interval)``: one jitted program per step.

    The train step is traced inline (its own shardings become constraints), so the
    update and the metric bookkeeping are one dispatch. The function carries the train
    step's name, so compile counts by that name keep their meaning. The same arguments
    give the same jitted function, so a second ``fit`` with the same step compiles
    nothing new.
    """
    leaves, treedef = jax.tree.flatten(state_shardings)
    return _accumulating_step(train_step, layout, (treedef, tuple(leaves)), mesh, donate_state)


@functools.lru_cache(maxsize=16)
def _accumulating_step(
    train_step: StepFn,
    layout: MetricLayout,
    state_shardings: tuple[Any, tuple[Any, ...]],
    mesh: Mesh,
    donate_state: bool,
) -> Callable[[Any, Any, Interval], tuple[Any, Interval]]:
    treedef, sharding_leaves = state_shardings  # flattened: hashable
    replicated = replicated_sharding(mesh)

    def step(state: Any, batch: Any, interval: Interval) -> tuple[Any, Interval]:
        state, metrics = train_step(state, batch)
        return state, _add(layout, interval, metrics)

    name = getattr(train_step, "__name__", "train_step")
    step.__name__ = step.__qualname__ = name
    return jax.jit(
        step,
        out_shardings=(
            jax.tree.unflatten(treedef, sharding_leaves),
            replicated,
        ),
        donate_argnums=(0,) if donate_state else (),
    )


@dataclasses.dataclass(frozen=True)
class IntervalRead:
    """One interval, read on the host.

    Attributes:
      first: the interval's first step.
      last: its last step.
      means: each metric's mean over the interval's steps.
      first_bad_step: the first step with a non-finite watched metric, or ``None``.
    """

    first: int
    last: int
    means: dict[str, Any]
    first_bad_step: int | None


class TracedStep(NamedTuple):
    """What a jitted train step's trace tells the programs that call it.

    Attributes:
      layout: where each of its metrics lives in the packed vector.
      donates_state: whether it donates the state (the calling program then does too).
      state_shardings: the state's shardings, for the calling program's outputs.
      jaxpr: the step's jaxpr.
    """

    layout: MetricLayout
    donates_state: bool
    state_shardings: Any
    jaxpr: Any


def trace_step(train_step: StepFn, state: Any, batch: Any) -> TracedStep:
    """Traces a jitted ``train_step`` on ``state`` and ``batch`` (arrays or abstract
    values), running nothing.

    It is traced on shapes and dtypes alone, as it is when a calling program traces
    it, so that trace finds this one in JAX's cache instead of tracing it again."""
    leaves = jax.tree.leaves(state)
    mesh = getattr(leaves[0].sharding, "mesh", None) if leaves else None
    where = None if mesh is None else NamedSharding(mesh.abstract_mesh, PartitionSpec())

    def abstract(leaf: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)

    traced = train_step.trace(*jax.tree.map(abstract, (state, batch)))  # pyright: ignore[reportFunctionMemberAccess]
    return TracedStep(
        layout=MetricLayout.of(traced.out_info[1]),
        donates_state=any(info.donated for info in jax.tree.leaves(traced.args_info[0][0])),
        state_shardings=jax.tree.map(lambda leaf: leaf.sharding, state),
        jaxpr=traced.jaxpr.jaxpr,
    )


def read_interval(layout: MetricLayout, interval: Interval, last: int) -> IntervalRead:
    """Copies ``interval`` (which ended at step ``last``) to the host; blocks until it is ready."""
    sums, steps, first_bad = to_host(interval)
    return host_interval_read(layout, sums, int(steps), int(first_bad), last)


def host_interval_read(
    layout: MetricLayout, sums: np.ndarray, count: int, first_bad: int, last: int
) -> IntervalRead:
    """An interval's host values, ended at step ``last``: ``sums`` (float32), its
    ``count`` of steps and ``first_bad`` (1-based; 0: every step finite)."""
    first = last - count + 1
    means = layout.unpack(sums / max(count, 1))
    return IntervalRead(first, last, means, first + first_bad - 1 if first_bad else None)


@dataclasses.dataclass(frozen=True)
class MetricSums:
    """A train step fused with sums of its metrics on the device, read once per interval.

    For a loop of your own (its means equal ``fit``'s log lines). ``first_step`` runs
    the first step and returns this object; its ``step(state, batch, interval)`` runs
    each later step as one jitted program that also adds the step's metrics (packed into
    one float32 vector) to the running ``Interval``, with a step count and the position
    of the first step whose ``loss`` or ``grad_norm`` was not finite. Nothing is read on
    the host until ``read``: call ``copy_to_host_async`` when an interval closes, keep
    going, and ``read`` it once its last step has left the queue (``InFlight``), so the
    read does not stall the devices. Start the next interval from ``zeros``.

    A jitted train step is traced (not run twice) for its metric names and donation,
    and the fused program donates the state exactly when the step does. A train step
    written as plain Python runs as it is, and a second small program adds its metrics.

    An interval is a pytree of three replicated arrays: ``sums`` (every metric element,
    summed), ``steps`` (its step count; a small output to wait on, the token to give
    ``InFlight.push``) and ``first_bad``. ``read`` gives an ``IntervalRead``: ``first``
    and ``last`` (its steps), ``means`` (each metric's mean over them) and
    ``first_bad_step`` (the first step whose watched metrics were not finite, or ``None``).

    Attributes:
      layout: where each metric lives in the packed vector.
      step: ``step(state, batch, interval) -> (state, interval)``.
      zeros: an empty interval, replicated on the mesh.

    Examples:
        >>> import jax, jax.numpy as jnp, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> batches = [
        ...     meshkit.shard_batch({"x": jnp.full((8,), float(k))}, meshkit.batch_sharding(mesh))
        ...     for k in range(1, 5)
        ... ]
        >>> @jax.jit
        ... def train_step(count, batch):
        ...     return count + 1, {"loss": jnp.mean(batch["x"])}
        >>> count = meshkit.replicate(jnp.zeros((), jnp.int32), mesh)
        >>> sums, count, interval = MetricSums.first_step(train_step, count, batches[0], mesh=mesh)
        >>> count, interval = sums.step(count, batches[1], interval)
        >>> sums.read(interval, last_step=2).means  # the mean of steps 1 and 2
        {'loss': 1.5}
        >>> interval = sums.zeros
        >>> for batch in batches[2:]:
        ...     count, interval = sums.step(count, batch, interval)
        >>> sums.read(interval, last_step=4)
        IntervalRead(first=3, last=4, means={'loss': 3.5}, first_bad_step=None)
    """

    layout: MetricLayout
    step: Callable[[Any, Any, Interval], tuple[Any, Interval]]
    zeros: Interval

    @classmethod
    def first_step(
        cls, train_step: StepFn, state: Any, batch: Any, *, mesh: Mesh
    ) -> tuple[MetricSums, Any, Interval]:
        """Runs the first step: returns the sums, the state after it, and its interval.

        Args:
          train_step: ``step(state, batch) -> (state, metrics)``, jitted or not, with
            ``metrics`` a dict of arrays that holds ``loss`` (or ``grad_norm``).
          state: the train state, placed on ``mesh``.
          batch: the first batch.
          mesh: the mesh the interval is replicated on.
        """
        if not hasattr(train_step, "trace"):
            state, metrics = train_step(state, batch)
            layout = MetricLayout.of(metrics)
            update = interval_update(layout, mesh)
            zeros = zero_interval(layout, mesh)

            def unfused(state: Any, batch: Any, interval: Interval) -> tuple[Any, Interval]:
                state, metrics = train_step(state, batch)
                return state, update(interval, metrics)

            return cls(layout, unfused, zeros), state, update(zeros, metrics)
        traced = trace_step(train_step, state, batch)
        layout = traced.layout
        fused = accumulating_step(
            train_step, layout, traced.state_shardings, mesh, donate_state=traced.donates_state
        )
        zeros = zero_interval(layout, mesh)
        state, interval = fused(state, batch, zeros)
        return cls(layout, fused, zeros), state, interval

    @staticmethod
    def copy_to_host_async(interval: Interval) -> None:
        """Starts copying ``interval`` to the host, so a later ``read`` finds it there."""
        for leaf in interval:
            leaf.copy_to_host_async()

    def read(self, interval: Interval, last_step: int) -> IntervalRead:
        """``interval`` (which ended at ``last_step``) on the host; waits until it is ready.

        The caller checks ``first_bad_step``: ``fit`` raises ``NonFiniteLossError``.
        """
        return read_interval(self.layout, interval, last_step)
