"""Many steps per dispatch: the train step scanned over a chunk of batches in one program.

A small model's step takes a few microseconds of device time and about as long again
on the host to dispatch. ``chunk_program`` runs ``n`` steps inside one jitted program
(``lax.scan``): the batches come in stacked (host input) or are gathered on the
devices from their source indices (resident data), the metrics are summed on the
device as in ``MetricSums``, and each log interval that closes inside the chunk is
emitted as one row of a small stacked output, so log lines are the same whatever the
chunk size. ``ChunkSizes`` says how many steps each dispatch takes: a fixed number, or
``'auto'``, which measures the dispatch overhead at the start of the run.

The state after ``n`` steps is the state after the same ``n`` steps run one per
dispatch: bit for bit when the steps are unrolled, and up to how XLA compiles the step
inside a loop body otherwise (measured on a CPU: the tiny MLP's loop is bit-identical
over 200 steps; the MNIST CNN's is 6e-8 away after 8 steps).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, Literal

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from meshkit._host import replicated_sharding
from meshkit.train._interval import Interval, MetricLayout, _add

BatchOf = Callable[[Any, Any], Any]
"""``batch_of(data, x) -> batch``: one step's batch from the chunk's per-step input ``x``
(a batch itself, or source indices into the resident ``data``)."""

ChunkFn = Callable[[Any, Interval, Any, Any, int], tuple[Any, Interval, Interval]]


def chunk_program(
    train_step: Callable[..., Any],
    layout: MetricLayout,
    state_shardings: Any,
    mesh: Mesh,
    *,
    donate_state: bool,
    batch_of: BatchOf,
    log_every: int,
    unroll: bool,
) -> ChunkFn:
    """``run(state, interval, data, xs, first_step) -> (state, interval, rows)``.

    Runs one step per leading entry of ``xs`` (steps ``first_step, first_step + 1,
    ...``). ``rows`` stacks the running interval after each step; after a step that
    closes a log line (a multiple of ``log_every``) the carried interval starts again
    from zeros, so row ``k`` of such a step is that line's whole interval. ``unroll``
    writes the chunk's steps out one after another instead of a loop (XLA:CPU runs a
    convolution inside a loop body an order of magnitude slower than outside one:
    15x for the MNIST CNN's step; its compile time then grows with the chunk). The same
    arguments give the same jitted function (a second ``fit`` compiles nothing), and it
    carries the train step's name, so compile counts by that name keep their meaning.
    """
    leaves, treedef = jax.tree.flatten(state_shardings)
    return _chunk_program(
        train_step,
        layout,
        (treedef, tuple(leaves)),
        mesh,
        donate_state=donate_state,
        batch_of=batch_of,
        log_every=log_every,
        unroll=unroll,
    )


@functools.lru_cache(maxsize=16)
def _chunk_program(
    train_step: Callable[..., Any],
    layout: MetricLayout,
    state_shardings: tuple[Any, tuple[Any, ...]],
    mesh: Mesh,
    *,
    donate_state: bool,
    batch_of: BatchOf,
    log_every: int,
    unroll: bool,
) -> ChunkFn:
    treedef, sharding_leaves = state_shardings
    replicated = replicated_sharding(mesh)

    def run(state: Any, interval: Interval, data: Any, xs: Any, first_step: Any):
        def one_step(carry: tuple[Any, Interval, jax.Array], x: Any):
            state, interval, step = carry
            state, metrics = train_step(state, batch_of(data, x))
            interval = _add(layout, interval, metrics)
            closes = step % log_every == 0
            restarted = Interval(*(jnp.where(closes, jnp.zeros_like(v), v) for v in interval))
            return (state, restarted, step + 1), interval

        start = jnp.asarray(first_step, jnp.int32)
        steps = jax.tree.leaves(xs)[0].shape[0]
        carry = (state, interval, start)
        if steps == 1:  # no loop at all: the step as it runs on its own
            (state, interval, _), row = one_step(carry, jax.tree.map(lambda v: v[0], xs))
            return state, interval, jax.tree.map(lambda v: v[None], row)
        (state, interval, _), rows = jax.lax.scan(one_step, carry, xs, unroll=unroll)
        return state, interval, rows

    name = getattr(train_step, "__name__", "train_step")
    run.__name__ = run.__qualname__ = name
    return jax.jit(
        run,
        out_shardings=(jax.tree.unflatten(treedef, sharding_leaves), replicated, replicated),
        donate_argnums=(0,) if donate_state else (),
    )


OVERHEAD_TARGET = 0.03
"""``'auto'`` chooses the smallest chunk whose dispatch overhead is below this share of
the time per step."""

LONG_STEP_SECONDS = 0.02
"""A step at least this long keeps one step per dispatch under ``'auto'`` without a
probe. A dispatch costs tens of microseconds on an accelerator (where it overlaps the
steps queued before it) and measured 100 to 830 us of host work on a CPU (tiny MLPs
and ensembles of them on 1 and 8 fake devices), a few percent of such a step at most,
while the probe's compile (an unrolled chunk of a large step on a CPU) can take longer
than the run saves: every probe of the MNIST CNN on 8 fake CPU devices (31 to 40 ms a
step) measured no dispatch cost at all, and the ensemble recipe's probe added a
quarter to its run."""

MIN_COMPILE_SECONDS = 0.05
"""The least ``'auto'`` expects a chunk size it has not run yet to cost in compile time.
The probe's own dispatch measures it, but in a process that ran the same step before
(a sweep's next stage, a notebook's second ``fit``) the probe is compiled already and
its dispatch takes microseconds, while a new size still compiles (the tiny MLP's
chunk: 0.1 to 0.3 s on a CPU)."""

MAX_AUTO_STEPS = 256
"""The largest chunk ``'auto'`` chooses on an accelerator."""

MAX_UNROLLED_AUTO_STEPS = 16
"""The largest chunk ``'auto'`` chooses where chunks are unrolled (their compile time
grows with their size)."""


def unrolls_chunks(mesh: Mesh, jaxpr: Any) -> bool:
    """Whether chunks of the step ``jaxpr`` on ``mesh`` are unrolled: on CPUs, for a step
    with a convolution (see ``chunk_program``); a loop everywhere else."""
    return mesh.devices.flat[0].platform == "cpu" and _has_convolution(jaxpr)


def _has_convolution(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _has_convolution(sub):
                return True
    return False


_WARM_STEPS = 4  # untimed one-step dispatches after the compile, before the timing
_TIMED_STEPS = 24  # one-step dispatches timed together


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Seconds per step at two chunk sizes, and what they say about the dispatch cost.

    ``per_step(n) = device + overhead / n``: ``overhead`` is what each dispatch adds
    (host work, launch and the gap it leaves on the device), ``device`` the step itself.
    """

    one: float
    probe_steps: int
    probe: float

    @property
    def overhead(self) -> float:
        """Seconds a dispatch adds, from the two rates."""
        return max(0.0, (self.one - self.probe) / (1 - 1 / self.probe_steps))

    @property
    def device(self) -> float:
        """Seconds of a step without its dispatch."""
        return max(self.one - self.overhead, 1e-9)

    def share(self, steps: int) -> float:
        """The dispatch's share of the time per step, at ``steps`` per dispatch."""
        cost = self.overhead / steps
        return cost / (self.device + cost)


def auto_steps(
    measured: Measurement,
    period: int,
    *,
    target: float = OVERHEAD_TARGET,
    most: int = MAX_AUTO_STEPS,
    compiled: int | None = None,
) -> int:
    """The smallest divisor of ``period`` (up to ``most``) whose dispatch share is below
    ``target``; the largest such divisor when none is; one step when the probe ran no
    faster per step than single steps (an unrolled CNN chunk on a CPU ran 0.6x as fast,
    measured: the dispatch was free, the chunk was not). A chunk size already ``compiled``
    (the measurement's probe) that meets the target is kept, even where a smaller one
    would: a smaller chunk saves nothing a run shows and costs a compile, which on a
    short run is most of what the chunks save (measured: the tiny MLP on 8 fake CPU
    devices, 1,200 steps).

    Divisors of the period between checkpoints and evaluations keep every chunk whole:
    no step runs in a shorter chunk except around a resume or the last step.

    Examples:
        >>> fast = Measurement(one=48e-6, probe_steps=50, probe=17e-6)  # tiny MLP on a CPU
        >>> auto_steps(fast, 100), auto_steps(fast, 96), auto_steps(fast, 10)
        (100, 96, 10)
        >>> slow = Measurement(one=20e-3, probe_steps=50, probe=19.99e-3)  # a big step
        >>> auto_steps(slow, 100)
        1
        >>> eight = Measurement(one=1.6e-3, probe_steps=50, probe=1.4e-3)  # 8 fake devices
        >>> auto_steps(eight, 100), auto_steps(eight, 100, compiled=50)
        (5, 50)
        >>> unrolled = Measurement(one=31e-3, probe_steps=16, probe=48e-3)  # slower per step
        >>> auto_steps(unrolled, 96, compiled=16)
        1
    """
    if measured.overhead == 0:  # the chunk ran no faster per step: dispatching costs nothing
        return 1
    divisors = [d for d in range(1, min(period, most) + 1) if period % d == 0]
    if compiled in divisors and measured.share(compiled) <= target:
        return compiled
    for steps in divisors:
        if measured.share(steps) <= target:
            return steps
    return divisors[-1]


def probe_steps(period: int, most: int = 64) -> int:
    """The chunk size ``'auto'`` times against one-step dispatches: the largest divisor of
    ``period`` that is at most ``most`` and leaves room for two chunks in one period."""
    bound = max(1, min(most, period // 2))
    return max(d for d in range(1, bound + 1) if period % d == 0)


StepsPerDispatch = int | Literal["auto"]


@dataclasses.dataclass(frozen=True)
class _StepRecord:
    """What ``'auto'`` measured of one step, for later runs of it in the process."""

    one: float  # seconds per step, one per dispatch
    bound: float  # the most a dispatch can cost, seconds
    first_dispatch: float | None  # the run's first dispatch, its compile included
    measurement: Measurement | None  # the probe's, where one ran
    probe_compile: float | None  # the probe's first dispatch, seconds


_MEASURED: dict[Hashable, _StepRecord] = {}
"""``'auto'``'s measurements by step (program, shapes and input), oldest first."""
_MEASURED_MAX = 32


class ChunkSizes:
    """How many steps each dispatch takes, and, for ``'auto'``, the measurement that decides.

    The loop asks ``timing_group(room)`` and then ``next(room)`` (``room``: steps left
    before the next checkpoint, evaluation or the end). A fixed size runs whole chunks
    and, where fewer steps than a chunk are left, one step per dispatch: two compiled
    sizes in all. ``'auto'`` starts with one-step dispatches: a few to warm up, then a
    timed group of them; then one chunk of ``probe_steps(period)`` (its compile), a
    timed group of two such chunks, and from there on ``auto_steps``'s choice. A timed
    group lies inside one segment between boundaries, so no save or evaluation is
    timed with it; the loop waits for the devices around it and reports its seconds
    to ``timed``.
    """

    def __init__(self, setting: StepsPerDispatch, period: int, *, most: int = MAX_AUTO_STEPS):
        self.setting = setting
        self.period = period
        self.most = most
        self.chosen: int | None = setting if isinstance(setting, int) else None
        self.measurement: Measurement | None = None
        self._phase: Literal["warm", "time", "compile", "probe", "done"] = "warm"
        self._warm_left = _WARM_STEPS
        self._one: float | None = None
        self._first_dispatch: float | None = None  # seconds, its compile included
        self._probe_compile: float | None = None  # the probe's first dispatch, seconds
        self._unrolled = False
        self._outweighed: tuple[float, float] | None = None  # (compile, saving) estimates
        self._key: Hashable | None = None  # the step's, for the process's record of it
        self._bound: float | None = None  # the most a dispatch can cost, seconds
        self.recalled = False
        """Whether the choice came from an earlier run's measurement of the same step."""
        if self.chosen is None and self.probe == 1:
            self.chosen = 1  # boundaries every step or two: nothing to gain

    @property
    def probe(self) -> int:
        """The chunk size timed against one-step dispatches."""
        return probe_steps(self.period, min(64, self.most))

    def timing_group(self, room: int) -> tuple[int, int] | None:
        """``(dispatches, steps each)`` to run and time as one group now, or ``None``."""
        if self.chosen is not None:
            return None
        if self._phase == "time" and room >= _TIMED_STEPS:
            return _TIMED_STEPS, 1
        if self._phase == "probe" and room >= 2 * self.probe:
            return 2, self.probe
        return None

    def next(self, room: int) -> int:
        """The steps of the next dispatch outside a timed group (``1 <= steps <= room``)."""
        if self.chosen is not None:
            return self.chosen if room >= self.chosen else 1
        if self._phase == "compile" and room >= self.probe:
            return self.probe
        return 1

    def first_dispatch(
        self,
        seconds: float,
        *,
        unrolled: bool,
        key: Hashable | None = None,
        left: int | None = None,
    ) -> None:
        """Records the run's first dispatch (one step, traced and compiled, waited for)
        and whether chunks unroll the step: together they estimate a chunk's compile.

        ``key`` names the step (its program and the shapes it runs on). Where an earlier
        run in this process measured the same step, the choice comes from that
        measurement and the ``left`` steps of this run: no timing and no probe again (a
        sweep's stages, a notebook's second ``fit``). With several processes each run
        measures afresh (every process must decide alike).
        """
        self._first_dispatch = seconds
        self._unrolled = unrolled
        if unrolled:
            self.most = min(self.most, MAX_UNROLLED_AUTO_STEPS)
        if self.chosen is None and key is not None and jax.process_count() == 1:
            self._key = key
            earlier = _MEASURED.get(key)
            if earlier is not None:
                self._recall(earlier, left)

    def dispatch_took(self, steps: int, seconds: float) -> None:
        """Records how long queuing a dispatch of ``steps`` steps took on the host: for
        the probe's first dispatch, mostly its compile."""
        if self._phase == "probe" and steps == self.probe and self._probe_compile is None:
            self._probe_compile = seconds

    def ran(self, steps: int) -> None:
        """Counts a dispatch of ``steps`` steps outside a timed group."""
        if self._phase == "warm":
            self._warm_left -= steps
            if self._warm_left <= 0:
                self._phase = "time"
        elif self._phase == "compile" and steps == self.probe:
            self._phase = "probe"

    def timed(self, steps: int, seconds: float, *, queuing: float, left: int | None = None) -> None:
        """Records a timed group of ``steps`` steps in all that took ``seconds``, of which
        the host spent ``queuing`` building and queuing them; ``left`` steps of the run
        come after it.

        After the one-step group: when even twice the host's queuing time per dispatch
        (a bound on what a dispatch costs) is below the target share of a step, or the
        step takes ``LONG_STEP_SECONDS`` or more, the step is long enough as it is: one
        step per dispatch, with no probe to compile. So it is when the probe's compile
        (estimated from the first dispatch's: as long for a loop, the probe's steps
        times as long unrolled) would take longer than that bound saves over the
        ``left`` steps: measured, a 150-step sweep of 16 CNNs on 8 fake CPU devices spent
        8 s compiling an unrolled 10-step chunk to save under 1 s.

        With several processes every one of them decides from the same numbers, the
        slowest process's (gathered here, at the same step in each): a chunk size
        chosen apart would pair one process's chunk program with another's single
        steps, whose collectives do not match.
        """
        if self._phase in ("time", "probe"):
            seconds, queuing = self._agreed(seconds, queuing)
        if self._phase == "time":
            self._one = seconds / steps
            self._bound = 2 * queuing / steps  # what a dispatch can cost at most
            self._phase = "compile"
            if self._one_step_is_enough(left):
                self._remember()
        elif self._phase == "probe":
            assert self._one is not None
            self.measurement = Measurement(self._one, self.probe, seconds / steps)
            self.chosen = auto_steps(
                self.measurement, self.period, most=self.most, compiled=self.probe
            )
            self._phase = "done"
            if self.chosen > self.probe and not self._pays(self.chosen, self.probe, left):
                self.chosen = self.probe
            self._remember()

    def _one_step_is_enough(self, left: int | None) -> bool:
        """Chooses one step per dispatch, with no probe, when the one-step timing says
        dispatching costs little or the probe's compile would outweigh its saving."""
        assert self._one is not None and self._bound is not None
        if self._bound <= OVERHEAD_TARGET * self._one or self._one >= LONG_STEP_SECONDS:
            self.chosen, self._phase = 1, "done"
            return True
        if left is not None and self._first_dispatch is not None:
            compile_cost = self._first_dispatch * (self.probe if self._unrolled else 1)
            saving = self._bound * left
            if compile_cost > saving:
                self.chosen, self._phase = 1, "done"
                self._outweighed = (compile_cost, saving)
                return True
        return False

    def _remember(self) -> None:
        """Keeps what was measured of this step for later runs in the process."""
        if self._key is None or self._one is None or self._bound is None:
            return
        _MEASURED[self._key] = _StepRecord(
            self._one, self._bound, self._first_dispatch, self.measurement, self._probe_compile
        )
        while len(_MEASURED) > _MEASURED_MAX:
            del _MEASURED[next(iter(_MEASURED))]

    def _recall(self, earlier: _StepRecord, left: int | None) -> None:
        """Chooses from an earlier run's measurement of the same step (see
        ``first_dispatch``); keeps measuring where that one decided nothing for this run."""
        self._one, self._bound = earlier.one, earlier.bound
        self._first_dispatch = earlier.first_dispatch
        measured = earlier.measurement
        if measured is None:
            # One step was enough then; this run may be long enough to pay for a probe.
            self.recalled = self._one_step_is_enough(left)
            if not self.recalled:
                self._one = self._bound = None
                self._outweighed = None
            return
        self.measurement, self._probe_compile = measured, earlier.probe_compile
        compiled = measured.probe_steps  # its chunk program is compiled in this process
        chosen = auto_steps(measured, self.period, most=self.most, compiled=compiled)
        fallback = compiled if chosen > compiled and self.period % compiled == 0 else 1
        if chosen not in (1, compiled) and not self._pays(chosen, fallback, left):
            chosen = fallback
        self.chosen, self._phase, self.recalled = chosen, "done", True

    def _agreed(self, seconds: float, queuing: float) -> tuple[float, float]:
        """``seconds`` and ``queuing`` (and the compile times recorded so far) as the
        slowest process measured them; this process's own where it is the only one."""
        if jax.process_count() == 1:
            return seconds, queuing
        mine = [seconds, queuing, self._first_dispatch or 0.0, self._probe_compile or 0.0]
        slowest = np.asarray(multihost_utils.process_allgather(np.asarray(mine))).max(axis=0)
        if self._first_dispatch is not None:
            self._first_dispatch = float(slowest[2])
        if self._probe_compile is not None:
            self._probe_compile = float(slowest[3])
        return float(slowest[0]), float(slowest[1])

    def _pays(self, chosen: int, than: int, left: int | None) -> bool:
        """Whether a ``chosen`` chunk, a size not compiled yet, saves more than its
        compile costs over the ``left`` steps, against chunks of ``than`` (its compile
        estimated from the probe's: as long for a loop, in proportion to the steps
        unrolled). Measured: an ensemble of 8 tiny MLPs on one CPU device chose 80 to
        250 steps over a 50-step probe, and each new size's compile took longer than a
        4,000-step run saved with it."""
        if left is None or self._probe_compile is None or self.measurement is None:
            return True
        saving = left * self.measurement.overhead * (1 / than - 1 / chosen)
        measured = max(self._probe_compile, MIN_COMPILE_SECONDS)
        compile_cost = measured * (chosen / self.measurement.probe_steps if self._unrolled else 1)
        return saving > compile_cost

    def describe(self) -> str:
        """``100 steps per dispatch (auto: 31 us per dispatch, 16 us per step)``."""
        steps = self.chosen or 1
        text = f"{steps} step{'s' if steps != 1 else ''} per dispatch"
        earlier = ", measured by an earlier run" if self.recalled else ""
        if self.measurement is not None:
            m = self.measurement
            text += (
                f" (auto: {_duration(m.overhead)} per dispatch, {_duration(m.device)} per "
                f"step{earlier})"
            )
        elif self.setting == "auto" and self._outweighed is not None:
            compile_cost, saving = self._outweighed
            text += (
                f" (auto: a {self.probe}-step chunk would take about {_duration(compile_cost)} "
                f"to compile and save under {_duration(saving)} over the steps left{earlier})"
            )
        elif self.setting == "auto" and self._one is not None and self.chosen == 1:
            text += (
                f" (auto: {_duration(self._one)} per step, its dispatch under 3% of it{earlier})"
            )
        elif self.setting == "auto":
            text += " (auto: the run ended before the measurement)"
        return text


def _duration(seconds: float) -> str:
    """``"41 us"`` under 10 ms, ``"196 ms"`` under a second, ``"8.4 s"`` from there.

    Examples:
        >>> _duration(41e-6), _duration(0.196), _duration(8.42), _duration(0.0)
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
