"""How ``fit`` runs its steps, behind one interface.

- ``StepProgram``: a jitted (traceable) train step, ``n`` steps per program
  (``chunk_program``; ``n = 1`` is one step per dispatch) from a ``Feed``: host
  batches or resident data.
- ``PlainSteps``: a train step written as plain Python (host logic between jitted
  calls), one call per step on host batches.

Each one ``fetch``es a dispatch's input and ``dispatch``es it, returning the state and
its steps' metrics (``Dispatched``, read on the host when the dispatch has left the
queue).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshkit._host import array_to_host, replicated_sharding
from meshkit.data import GlobalBatchIterator
from meshkit.data._feed import Feed
from meshkit.train._chunks import Loop, at, chunk_program, loop_for
from meshkit.train._interval import MetricLayout, TracedStep, trace_step


@dataclasses.dataclass
class Dispatched:
    """One dispatch's metrics, still on the devices: ``rows[k]`` holds step
    ``first + k``'s (``MetricLayout.pack``, replicated), for its ``count`` steps; ``read``
    takes them when the dispatch has left the queue."""

    rows: jax.Array
    first: int
    count: int
    copy_ahead: dataclasses.InitVar[bool]
    """Start the rows' copy to the host now (``copies_ahead``)."""

    def __post_init__(self, copy_ahead: bool) -> None:
        if copy_ahead:
            self.rows.copy_to_host_async()

    def read(self) -> np.ndarray:
        """The rows on the host (waits for the dispatch)."""
        return array_to_host(self.rows)[: self.count]


def copies_ahead(mesh: Mesh) -> bool:
    """Whether a dispatch's rows are copied to the host as soon as it is queued
    (``copy_to_host_async``), so that reading them later does not wait for a copy: on
    accelerators. A CPU device's arrays are in host memory already."""
    return mesh.devices.flat[0].platform != "cpu"


class PlainSteps:
    """One call per step of a plain-Python train step, on host batches placed ahead;
    a second small program packs each step's metrics."""

    loop: Loop = "counted"  # no program loops over its steps: only the type asks

    def __init__(
        self,
        train_step: Callable[..., Any],
        batches: GlobalBatchIterator,
        mesh: Mesh,
    ):
        self.train_step = train_step
        self.feed = batches
        self.mesh = mesh
        self._layout: MetricLayout | None = None
        self._copy_ahead = copies_ahead(mesh)

    def fetch(self, steps: int, chunk: int) -> Any:
        assert steps == chunk == 1
        return next(self.feed)

    def dispatch(self, state: Any, batch: Any, first: int, steps: int) -> tuple[Any, Dispatched]:
        state, metrics = self.train_step(state, batch)
        if self._layout is None:
            self._layout = MetricLayout.of(metrics)
        rows = _packed(self._layout, self.mesh)(metrics)
        return state, Dispatched(rows, first, 1, self._copy_ahead)

    @property
    def layout(self) -> MetricLayout:
        assert self._layout is not None
        return self._layout

    def describe(self) -> str:
        return "host, placed by a thread" if self.feed.in_thread else "host"


@functools.lru_cache(maxsize=16)
def _packed(layout: MetricLayout, mesh: Mesh) -> Callable[[Any], jax.Array]:
    """``metrics -> f32[1, size]``, replicated on ``mesh``."""
    return jax.jit(
        lambda metrics: layout.pack(metrics)[None], out_shardings=replicated_sharding(mesh)
    )


class StepProgram:
    """``steps`` steps of a jitted train step per dispatch (``chunk_program``), from a ``Feed``.

    One program runs every dispatch of at most ``largest`` steps (its trip count is an
    argument), or one per number of steps where it is unrolled (``loop_for``)."""

    def __init__(
        self,
        train_step: Callable[..., Any],
        feed: Feed,
        mesh: Mesh,
        *,
        largest: int,
    ):
        self.train_step = train_step
        self.largest = largest
        self.feed = feed
        self.mesh = mesh
        self._programs: dict[int, Callable[..., Any]] = {}
        self._traced: TracedStep | None = None
        self._copy_ahead = copies_ahead(mesh)
        self.loop: Loop = "counted"
        """How its programs loop over steps (known once the step is traced: ``loop_for``)."""

    def fetch(self, steps: int, chunk: int) -> tuple[Any, Any, int]:
        """The inputs of ``steps`` steps, where the loop runs ``chunk`` per dispatch."""
        return self.feed.next(steps, chunk=chunk)

    def dispatch(
        self, state: Any, inputs: tuple[Any, Any, int], first: int, steps: int
    ) -> tuple[Any, Dispatched]:
        data, xs, offset = inputs
        program = self._programs.get(self._key(steps)) or self._build(state, data, xs, steps)
        state, rows = program(state, data, xs, at(offset, steps))
        return state, Dispatched(rows, first, steps, self._copy_ahead)

    def _build(self, state: Any, data: Any, xs: Any, steps: int) -> Callable[..., Any]:
        """The program of ``steps`` steps (the first one traces the train step on one
        step's batch, for its metrics and donation)."""
        batch_of = self.feed.batch_of
        if self._traced is None:
            one = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype), xs)
            self._traced = trace_step(self.train_step, state, jax.eval_shape(batch_of, data, one))
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

    def describe(self) -> str:
        return self.feed.describe()


def runner(
    train_step: Callable[..., Any],
    pipeline: Any,
    data_state: dict[str, Any] | None,
    mesh: Mesh,
    *,
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
        return StepProgram(train_step, feed, mesh, largest=largest)
    if pipeline.resident_mode is not None or chunked:
        raise TypeError(
            "Several steps per dispatch and resident data need a jitted train step "
            f"(make_train_step, or jax.jit of your own), got {train_step!r}. Pass "
            "Dispatch(steps_per_dispatch=1) and a pipeline with resident=False to run "
            "a plain-Python step."
        )
    batches = GlobalBatchIterator(pipeline, state=data_state)
    return PlainSteps(train_step, batches, mesh)
