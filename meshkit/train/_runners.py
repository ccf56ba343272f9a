"""How ``fit`` runs its steps, behind one interface.

- ``StepProgram``: a jitted (traceable) train step, ``n`` steps per program
  (``chunk_program``; ``n = 1`` is one step per dispatch) from a ``Feed``: host
  batches or resident data.
- ``PlainSteps``: a train step written as plain Python (host logic between jitted
  calls), one call per step on host batches, its metrics summed by ``MetricSums``.

Each one ``fetch``es a dispatch's input and ``dispatch``es it, returning the state,
the running interval and the log intervals that closed in it (``Closed``, read on the
host when the dispatch has left the queue).
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
from meshkit.data._feed import Feed
from meshkit.train._chunks import Loop, at, chunk_program, loop_for
from meshkit.train._interval import (
    Interval,
    IntervalRead,
    MetricLayout,
    MetricSums,
    TracedStep,
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


class PlainSteps:
    """One call per step of a plain-Python train step, on host batches placed ahead."""

    loop: Loop = "fixed"

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


class StepProgram:
    """``steps`` steps of a jitted train step per dispatch (``chunk_program``), from a ``Feed``.

    One program runs every dispatch of at most ``largest`` steps (its trip count is an
    argument), or one per number of steps where the loop is fixed (``loop_for``)."""

    def __init__(
        self,
        train_step: Callable[..., Any],
        feed: Feed,
        mesh: Mesh,
        *,
        log_every: int,
        largest: int,
    ):
        self.train_step = train_step
        self.largest = largest
        self.feed = feed
        self.mesh = mesh
        self.log_every = log_every
        self._programs: dict[int, Callable[..., Any]] = {}
        self._traced: TracedStep | None = None
        self._zeros: Interval | None = None
        self.loop: Loop = "counted"
        """How its programs loop over steps (known once the step is traced: ``loop_for``)."""

    def fetch(self, steps: int) -> tuple[Any, Any, int]:
        return self.feed.next(steps)

    def dispatch(
        self,
        state: Any,
        interval: Interval | None,
        inputs: tuple[Any, Any, int],
        first: int,
        steps: int,
    ) -> tuple[Any, Interval, Closed]:
        data, xs, offset = inputs
        program = self._programs.get(self._key(steps)) or self._build(state, data, xs, steps)
        start = self.zeros if interval is None else interval
        state, carried, rows = program(state, start, data, xs, at(offset, first, steps))
        closing: list[tuple[int | None, int]] = [
            (step - first, step)
            for step in range(first, first + steps)
            if step % self.log_every == 0
        ]
        return state, carried, Closed(rows, closing)

    def _build(self, state: Any, data: Any, xs: Any, steps: int) -> Callable[..., Any]:
        """The program of ``steps`` steps (the first one traces the train step on one
        step's batch, for its metrics and donation)."""
        batch_of = self.feed.batch_of
        if self._traced is None:
            one = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), xs)
            self._traced = trace_step(self.train_step, state, jax.eval_shape(batch_of, data, one))
            self._zeros = zero_interval(self._traced.layout, self.mesh)
            self.loop = loop_for(self.mesh, self._traced.jaxpr)
        traced, counted = self._traced, self.loop == "counted"
        program = chunk_program(
            self.train_step,
            traced.layout,
            traced.state_shardings,
            self.mesh,
            loop=self.loop,
            steps=self.largest if counted else steps,
            donate_state=traced.donates_state,
            batch_of=batch_of,
            log_every=self.log_every,
        )
        self._programs[self._key(steps)] = program
        return program

    def _key(self, steps: int) -> int:
        """Where the program of ``steps`` steps is kept: one for every count on a
        counted loop (0), one per count otherwise."""
        return 0 if self.loop == "counted" else steps

    @property
    def layout(self) -> MetricLayout:
        assert self._traced is not None
        return self._traced.layout

    @property
    def zeros(self) -> Interval:
        assert self._zeros is not None
        return self._zeros

    def describe(self) -> str:
        return self.feed.describe()


def runner(
    train_step: Callable[..., Any],
    pipeline: Any,
    data_state: dict[str, Any] | None,
    mesh: Mesh,
    *,
    log_every: int,
    largest: int,
    chunked: bool,
) -> StepProgram | PlainSteps:
    """The step program for a jitted step (dispatches of up to ``largest`` steps), one
    call per step for a plain-Python one.

    Raises:
      TypeError: a plain-Python step with resident data or ``chunked`` dispatches.
    """
    if hasattr(train_step, "trace"):
        feed = Feed(pipeline, data_state, largest=largest)
        return StepProgram(train_step, feed, mesh, log_every=log_every, largest=largest)
    if pipeline.resident_mode is not None or chunked:
        raise TypeError(
            "Several steps per dispatch and resident data need a jitted train step "
            f"(make_train_step, or jax.jit of your own), got {train_step!r}. Pass "
            "Dispatch(steps_per_dispatch=1) and a pipeline with resident=False to run "
            "a plain-Python step."
        )
    batches = GlobalBatchIterator(pipeline, state=data_state)
    return PlainSteps(train_step, batches, mesh, log_every=log_every)
