"""The step program: ``n`` train steps in one jitted program, and how ``'auto'`` picks ``n``.

``chunk_program`` runs the train step ``n`` times inside one program (``n = 1``
included): a loop whose trip count is an argument, so one program serves every ``n``,
or, for a convolution on a CPU (``loop_for``), the steps written out. Its per-step inputs
``xs`` are a stack of host batches, or a block of source indices into resident data
that the program slices at an ``offset`` (the block stays on the devices for many
dispatches, so a dispatch sends two integers, not its batch's indices). It returns
each step's metrics as one row of a small table, which the host sums into log lines
(``LogLines``), so log lines are the same whatever ``n``.

``'auto'`` is a calibration at the start of a run (``Calibration``, ``choose_steps``):
it times one-step dispatches and two chunks of ``probe_steps`` steps; the loop then
runs the size chosen.

The state after ``n`` steps is the state after the same steps run one per dispatch,
bit for bit (tested for every ``Loop``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshkit._host import replicated_sharding
from meshkit.train._interval import MetricLayout

BatchOf = Callable[[Any, Any], Any]
"""``batch_of(data, x) -> batch``: one step's batch from the chunk's per-step input ``x``
(a batch itself, or source indices into the resident ``data``)."""

ChunkFn = Callable[[Any, Any, Any, Any], tuple[Any, jax.Array]]


Loop = Literal["counted", "unrolled"]
"""How a step program loops over its steps: ``"counted"``, a loop whose trip count is
an argument (one program for every number of steps); ``"unrolled"``, the steps written
out one after another (one program per number)."""


def chunk_program(
    train_step: Callable[..., Any],
    layout: MetricLayout,
    state_shardings: Any,
    mesh: Mesh,
    *,
    loop: Loop,
    steps: int,
    donate_state: bool,
    batch_of: BatchOf,
) -> ChunkFn:
    """``run(state, data, xs, at) -> (state, rows)``.

    ``at`` is ``int32[2]``: ``(offset, count)``. The program runs ``count`` steps on
    ``xs``'s entries ``offset, offset + 1, ...``; ``count`` is at most ``steps`` for a
    ``"counted"`` loop and equals it for an unrolled one. ``rows`` is ``f32[steps, layout.size]``:
    row ``k`` holds step ``k``'s metrics (``layout.pack``; past ``count``, zeros).

    The same arguments give the same jitted function (a second ``fit`` compiles
    nothing), and it carries the train step's name, so compile counts by that name
    keep their meaning.
    """
    leaves, treedef = jax.tree.flatten(state_shardings)
    return _chunk_program(
        train_step,
        layout,
        (treedef, tuple(leaves)),
        mesh,
        loop=loop,
        steps=steps,
        donate_state=donate_state,
        batch_of=batch_of,
    )


@functools.lru_cache(maxsize=32)
def _chunk_program(
    train_step: Callable[..., Any],
    layout: MetricLayout,
    state_shardings: tuple[Any, tuple[Any, ...]],
    mesh: Mesh,
    *,
    loop: Loop,
    steps: int,
    donate_state: bool,
    batch_of: BatchOf,
) -> ChunkFn:
    treedef, sharding_leaves = state_shardings

    def run(state: Any, data: Any, xs: Any, at: jax.Array) -> tuple[Any, jax.Array]:
        offset, count = at[0], at[1]

        def one_step(state: Any, x: Any) -> tuple[Any, jax.Array]:
            state, metrics = train_step(state, batch_of(data, x))
            return state, layout.pack(metrics)

        if loop == "counted":

            def body(i: jax.Array, carry: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
                state, rows = carry
                x = jax.tree.map(
                    lambda v: jax.lax.dynamic_index_in_dim(v, offset + i, keepdims=False), xs
                )
                state, row = one_step(state, x)
                return state, jax.lax.dynamic_update_index_in_dim(rows, row, i, 0)

            rows = jnp.zeros((steps, layout.size), jnp.float32)
            return jax.lax.fori_loop(0, count, body, (state, rows))
        mine = jax.tree.map(lambda v: jax.lax.dynamic_slice_in_dim(v, offset, steps), xs)
        rows = []  # unrolled: the steps written out
        for i in range(steps):
            state, row = one_step(state, jax.tree.map(lambda v, i=i: v[i], mine))
            rows.append(row)
        return state, jnp.stack(rows)

    name = getattr(train_step, "__name__", "train_step")
    run.__name__ = run.__qualname__ = name
    return jax.jit(
        run,
        out_shardings=(jax.tree.unflatten(treedef, sharding_leaves), replicated_sharding(mesh)),
        donate_argnums=(0,) if donate_state else (),
    )


def loop_for(mesh: Mesh, jaxpr: Any) -> Loop:
    """How the step programs of the step ``jaxpr`` loop on ``mesh``'s devices.

    - CPUs, a step with a convolution: ``"unrolled"``. XLA:CPU runs a convolution
      inside a loop body an order of magnitude slower than outside one (15x for the
      MNIST CNN's step); the compile time then grows with the steps.
    - everywhere else: ``"counted"``, one program for any number of steps, so a run
      compiles its step once (the calibration's chunks and the single steps around
      boundaries included). On GPUs XLA evaluates such a loop's condition on the host
      at each step, a round trip that a step of a few microseconds notices (the
      benchmarks page has the figures) and a real model's step does not.

    The two give the same bits (tested on a CPU).
    """
    if mesh.devices.flat[0].platform == "cpu" and _has_convolution(jaxpr):
        return "unrolled"
    return "counted"


def _has_convolution(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _has_convolution(sub):
                return True
    return False


CHUNK_GAIN = 0.9
"""``'auto'`` chooses the probed chunk only where its steps ran in at most this share
of a one-step dispatch's time: a chunk that is about as fast is not worth its compile,
and a timing's noise cannot flip the choice between two sizes that differ by more."""

TIMED_STEPS = 24
"""One-step dispatches timed together."""

MAX_PROBE_STEPS = 64
"""The largest chunk ``'auto'`` probes (and so chooses)."""


def probe_steps(period: int, most: int = MAX_PROBE_STEPS) -> int:
    """The chunk size ``'auto'`` times against one-step dispatches: the largest divisor of
    the boundary ``period`` that is at most ``most`` and half the period (every chunk
    between two checkpoints or evaluations is whole, and two fit between them).

    Examples:
        >>> probe_steps(100), probe_steps(96), probe_steps(7), probe_steps(100, most=16)
        (50, 48, 1, 10)
    """
    bound = max(1, min(period // 2, most))
    return max(d for d in range(1, bound + 1) if period % d == 0)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``'auto'`` measured at the start of a run, in seconds per step.

    Attributes:
      one: wall time per step at one step per dispatch (the devices waited for at the
        end of the timed group).
      probe_steps: the chunk size timed against them.
      chunk: wall time per step at ``probe_steps`` per dispatch, or ``None`` where no
        chunk was timed.
      loop: how the step programs loop (``loop_for``).
    """

    one: float
    probe_steps: int
    chunk: float | None = None
    loop: Loop = "counted"


def choose_steps(measured: Calibration) -> int:
    """``'auto'``'s steps per dispatch, from what the calibration measured: the probed
    chunk size where its steps took at most ``CHUNK_GAIN`` of a one-step dispatch's
    time, else one step (the chunk was about as fast, or slower, or not timed).

    Examples:
        >>> tiny = Calibration(one=340e-6, probe_steps=50, chunk=60e-6)
        >>> choose_steps(tiny)
        50
        >>> choose_steps(Calibration(one=1e-3, probe_steps=16, chunk=0.95e-3))
        1
        >>> choose_steps(Calibration(one=35e-3, probe_steps=16))  # untimed
        1
    """
    if measured.chunk is None:
        return 1
    return measured.probe_steps if measured.chunk <= CHUNK_GAIN * measured.one else 1


def describe_dispatch(steps: int, measured: Calibration | None, *, auto: bool) -> str:
    """``50 steps per dispatch (auto: 64 us per step at 1, 12 us at 50)``, for a summary.

    Examples:
        >>> describe_dispatch(1, None, auto=False)
        '1 step per dispatch'
        >>> describe_dispatch(1, Calibration(35e-3, 1), auto=True)
        '1 step per dispatch (auto: 35 ms per step; no chunk fits between the boundaries)'
        >>> describe_dispatch(50, Calibration(340e-6, 50, 60e-6), auto=True)
        '50 steps per dispatch (auto: 340 us per step at 1 per dispatch, 60 us at 50)'
    """
    text = f"{steps} step{'s' if steps != 1 else ''} per dispatch"
    if not auto:
        return text
    if measured is None:
        return text + " (auto: the run was too short to measure)"
    if measured.chunk is None and measured.loop == "unrolled":
        return (
            f"{text} (auto: {duration(measured.one)} per step; a chunk of it would be "
            "written out step by step on a CPU, so none was timed)"
        )
    if measured.chunk is None:
        why = "no chunk fits between the boundaries" if measured.probe_steps == 1 else "none timed"
        return f"{text} (auto: {duration(measured.one)} per step; {why})"
    return (
        f"{text} (auto: {duration(measured.one)} per step at 1 per dispatch, "
        f"{duration(measured.chunk)} at {measured.probe_steps})"
    )


def duration(seconds: float) -> str:
    """``"41 us"`` under 10 ms, ``"196 ms"`` under a second, ``"8.4 s"`` from there.

    Examples:
        >>> duration(41e-6), duration(0.196), duration(8.42), duration(0.0)
        ('41 us', '196 ms', '8.4 s', 'under 1 us')
    """
    if seconds < 0.5e-6:
        return "under 1 us"
    if seconds < 0.01:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def boundary_period(*periods: int | None) -> int:
    """The steps between boundaries that recur: the gcd of the given periods."""
    given = [p for p in periods if p]
    return math.gcd(*given) if given else 1


def at(offset: int, count: int) -> np.ndarray:
    """The ``at`` argument of a chunk program."""
    return np.asarray((offset, count), np.int32)
