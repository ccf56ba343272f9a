"""The two ways ``fit`` dispatches steps, behind one interface.

- ``PerStep``: one program per step on host batches (``MetricSums``): works for any
  train step, jitted or plain Python.
- ``Chunked``: ``n`` steps per program (``chunk_program``), on stacked host batches or
  on indices into resident data; needs a jitted train step.

Each one ``fetch``es a chunk's input and ``dispatch``es it, returning the state, the
running interval and the log intervals that closed in the chunk (``Closed``, read on
the host when the chunk has left the queue).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshkit._host import to_host
from meshkit.data import GlobalBatchIterator
from meshkit.train._chunks import chunk_program, unrolls_chunks
from meshkit.train._feeds import HostChunks, ResidentChunks
from meshkit.train._interval import (
    Interval,
    IntervalRead,
    MetricLayout,
    MetricSums,
    read_interval,
    trace_step,
    zero_interval,
)


@dataclasses.dataclass
class Closed:
    """The log intervals that closed in one dispatch, still on the devices.

    ``rows`` is an interval (one step: the interval itself) or a stack of intervals
    (a chunk: one row per step); ``at`` lists ``(row, step)`` for each closed line
    (``row`` ``None`` for an unstacked interval).
    """

    rows: Interval | None = None
    at: list[tuple[int | None, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.at and self.rows is not None:
            for leaf in self.rows:
                leaf.copy_to_host_async()  # read one dispatch late, when it is ready

    def reads(self, layout: MetricLayout) -> Iterator[IntervalRead]:
        """Each closed line's interval on the host (one copy for all of them)."""
        if not self.at or self.rows is None:
            return
        host: Any = [np.asarray(leaf) for leaf in to_host(self.rows)]
        rows = Interval(*host)
        for row, step in self.at:
            interval = rows if row is None else Interval(*(leaf[row] for leaf in rows))
            yield read_interval(layout, interval, step)


def _avals(tree: Any) -> tuple[Any, ...]:
    """The structure, shapes, types and shardings of ``tree``'s leaves: hashable."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, *((leaf.shape, leaf.dtype, getattr(leaf, "sharding", None)) for leaf in leaves)


class PerStep:
    """One dispatch per step, host batches placed ahead by a ``GlobalBatchIterator``."""

    chunked = False
    unrolled = False

    def __init__(
        self,
        train_step: Callable[..., Any],
        batches: GlobalBatchIterator,
        mesh: Mesh,
        *,
        log_every: int,
    ):
        self.train_step = train_step
        self.feed = batches
        self.mesh = mesh
        self.log_every = log_every
        self.sums: MetricSums | None = None

    def fetch(self, steps: int) -> Any:
        assert steps == 1
        return next(self.feed)

    def dispatch(
        self, state: Any, interval: Interval | None, batch: Any, first: int, steps: int
    ) -> tuple[Any, Interval, Closed]:
        if self.sums is None or interval is None:
            self.sums, state, interval = MetricSums.first_step(
                self.train_step, state, batch, mesh=self.mesh
            )
        else:
            state, interval = self.sums.step(state, batch, interval)
        if first % self.log_every:
            return state, interval, Closed()
        return state, self.sums.zeros, Closed(interval, [(None, first)])

    @property
    def layout(self) -> MetricLayout:
        assert self.sums is not None
        return self.sums.layout

    @property
    def zeros(self) -> Interval:
        assert self.sums is not None
        return self.sums.zeros

    def describe(self) -> str:
        return "host, placed by a thread" if self.feed.in_thread else "host"


class Chunked:
    """``steps`` steps per dispatch (``chunk_program``) from a chunk feed."""

    chunked = True

    def __init__(
        self,
        train_step: Callable[..., Any],
        feed: HostChunks | ResidentChunks,
        mesh: Mesh,
        *,
        log_every: int,
    ):
        if not hasattr(train_step, "trace"):
            raise TypeError(
                "Several steps per dispatch and resident data need a jitted train step "
                f"(make_train_step, or jax.jit of your own), got {train_step!r}. Pass "
                "Dispatch(steps_per_dispatch=1) and a pipeline with resident=False to run "
                "a plain-Python step."
            )
        self.train_step = train_step
        self.feed = feed
        self.mesh = mesh
        self.log_every = log_every
        self._program: Callable[..., Any] | None = None
        self.unrolled = False  # known once the step is traced (its first dispatch)
        self._layout: MetricLayout | None = None
        self._zeros: Interval | None = None
        self.step_key: Any = None
        """The compiled step and what it runs on (known once built): ``'auto'``'s record
        of its measurement is kept under this key."""

    def fetch(self, steps: int) -> tuple[Any, Any]:
        return self.feed.next_chunk(steps)

    def dispatch(
        self, state: Any, interval: Interval | None, inputs: tuple[Any, Any], first: int, steps: int
    ) -> tuple[Any, Interval, Closed]:
        data, xs = inputs
        program = self._program or self._build(state, data, xs)
        start = self.zeros if interval is None else interval
        state, carried, rows = program(state, start, data, xs, first)
        at: list[tuple[int | None, int]] = [
            (step - first, step)
            for step in range(first, first + steps)
            if step % self.log_every == 0
        ]
        return state, carried, Closed(rows, at)

    def _build(self, state: Any, data: Any, xs: Any) -> Callable[..., Any]:
        """Traces the train step on one step's batch (for its metrics and donation)."""
        batch_of = self.feed.batch_of
        one = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), xs)
        batch = jax.eval_shape(batch_of, data, one)
        traced = trace_step(self.train_step, state, batch)
        self._layout = traced.layout
        self.unrolled = unrolls_chunks(self.mesh, traced.jaxpr)
        self._program = chunk_program(
            self.train_step,
            self._layout,
            traced.state_shardings,
            self.mesh,
            donate_state=traced.donates_state,
            batch_of=batch_of,
            log_every=self.log_every,
            unroll=self.unrolled,
        )
        self._zeros = zero_interval(self._layout, self.mesh)
        self.step_key = (self._program, _avals(state), _avals(one), self.feed.describe())
        return self._program

    @property
    def layout(self) -> MetricLayout:
        assert self._layout is not None
        return self._layout

    @property
    def zeros(self) -> Interval:
        assert self._zeros is not None
        return self._zeros

    def describe(self) -> str:
        return self.feed.describe()
