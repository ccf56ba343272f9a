"""The fit loop: steps queued ahead, their metrics read one dispatch late, the host waiting at
boundaries only."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from meshkit._compiles import count_compiles
from meshkit._host import to_host
from meshkit._inflight import InFlight
from meshkit._paths import PathLike
from meshkit._runtime import PreemptionWatcher, StallWatch
from meshkit._types import Batch, Metrics
from meshkit._workdir import claimed
from meshkit.checkpoint._checkpointer import Checkpointer, Restored
from meshkit.checkpoint._orbax import disk_full
from meshkit.data import TrainPipeline
from meshkit.train._chunks import (
    TIMED_STEPS,
    Calibration,
    boundary_period,
    choose_steps,
    describe_dispatch,
    probe_steps,
)
from meshkit.train._gradients import check_microbatch_rows
from meshkit.train._hooks import Boundary, BoundaryKind, Hook
from meshkit.train._interval import IntervalRead
from meshkit.train._label_diagnosis import labels_outside_classes
from meshkit.train._lines import LogLines
from meshkit.train._profile import StepProfiler
from meshkit.train._records import NonFiniteLossError, Records
from meshkit.train._runners import Dispatched, PlainSteps, StepProgram, runner
from meshkit.train._settings import Checkpoints, Dispatch, Evaluation, Logging
from meshkit.train._state import TrainState
from meshkit.train._writers import JsonlWriter

__all__ = ["FitResult", "NonFiniteLossError", "fit"]

FIT_FILES = ("checkpoints", "metrics.jsonl")
"""What ``fit`` writes in its workdir (besides ``profile`` and writers' folders, which
only add files): a folder without meshkit's marker must not hold others' under these."""


@dataclasses.dataclass
class FitResult:
    """What ``fit`` did.

    Attributes:
      state: the final train state.
      step: the number of steps taken in all (including those before a resume).
      resumed_from: the checkpoint step the run resumed from, or ``None``.
      preempted: whether a SIGTERM or a first Ctrl-C stopped the run early (after saving).
      stopped_early: whether a hook stopped the run early (after saving).
      train_metrics: the means of the train step's metrics over the last log interval.
      eval_metrics: the last evaluation (``count`` plus metric means), or ``{}``.
      steps_per_second: training throughput after the first step of this run
        (evaluation and checkpoint time excluded).
      input_wait_fraction: the share of this run's time spent waiting for input batches,
        after the first one.
      input_startup_seconds: the time the first batch took: opening the pipeline (its
        threads or Grain worker processes) and building its first batches.
      train_step_compiles: compilations of the train step during this run.
      max_in_flight: the most dispatches that were queued on the devices at once.
      input_path: how batches reached the devices: ``"host"``, or ``"resident
        (replicated, 4.5 MiB per device)"``.
      dispatch: how many steps each dispatch ran, and for ``'auto'`` what it measured.
      steps_per_dispatch: the steps each whole chunk ran (1: one step per dispatch);
        for ``'auto'``, its choice: pass it as ``Dispatch(steps_per_dispatch=...)`` to
        a later ``fit`` of the same step to skip the calibration.
      calibration: what ``'auto'`` measured (``None``: a fixed size, or a run too
        short to measure).
    """

    state: TrainState
    step: int
    resumed_from: int | None
    preempted: bool
    stopped_early: bool
    train_metrics: dict[str, Any]
    eval_metrics: dict[str, float]
    steps_per_second: float
    input_wait_fraction: float
    input_startup_seconds: float
    train_step_compiles: int
    max_in_flight: int
    input_path: str = "host"
    dispatch: str = "1 step per dispatch"
    steps_per_dispatch: int = 1
    calibration: Calibration | None = None


def fit(
    state: TrainState,
    train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]],
    pipeline: TrainPipeline,
    *,
    num_steps: int,
    workdir: PathLike,
    evaluation: Evaluation | None = None,
    checkpoints: Checkpoints | None = None,
    logging: Logging | None = None,
    dispatch: Dispatch | None = None,
    hooks: Sequence[Hook] = (),
    start_step: int | None = None,
) -> FitResult:
    """Trains ``state`` for ``num_steps`` steps, resuming from ``workdir`` if it holds a checkpoint.

    The host never waits for a step to finish before queuing the next: up to
    ``dispatch.max_in_flight`` dispatches are queued on the devices, and input batches
    are placed on them ahead of use by a background thread. Each dispatch returns its
    steps' metrics as a small table that the host copies once the dispatch has left
    the queue (so the copy does not stall it) and sums into a log line every
    ``logging.every`` steps; at evaluation, checkpoint and preemption boundaries it
    reads every step so far and checks that no step's loss or gradient norm was
    non-finite: a checkpoint is never written from a state that followed a
    non-finite step.

    Checkpoints hold the train state and the data iterator's state, so a killed run
    restarted with the same arguments continues exactly where the last checkpoint left
    it, on any mesh. A damaged newest checkpoint (its state differs from the digest
    saved with it, or a file is missing) is moved aside with a warning and the newest
    intact one is used (``Checkpointer.resume``); a save that fails in the background
    (a full disk) stops training at the next step with ``CheckpointSaveError``. A
    SIGTERM, or a first Ctrl-C, saves at the next step boundary and returns with
    ``preempted=True``; a second Ctrl-C stops at once.

    Args:
      state: the initial train state, placed on the mesh (from ``create_train_state``);
        when resuming it is the restore target, so its shardings decide the layout.
      train_step: from ``make_train_step`` (or any ``step(state, batch) -> (state,
        metrics)`` reporting ``metrics["loss"]``). ``fit`` runs it inside one jitted
        program that returns its metrics, and donates the state when the step does.
      pipeline: the training data.
      num_steps: total steps, counted from the start of the run (not of this resume).
      workdir: where checkpoints, ``metrics.jsonl`` and profiles go: a local folder
        or an object-store URI (``gs://bucket/run``; see ``etils.epath``). The run
        holds it while it trains: a second run into it raises ``WorkdirError`` naming
        the first, as does a folder whose ``checkpoints`` or ``metrics.jsonl`` meshkit
        did not write.
      evaluation: full evaluation, e.g. ``Evaluation(eval_pipeline, every=100)``;
        ``None``: no evaluation.
      checkpoints: when and where to save; ``None``: ``Checkpoints()`` (every 100
        steps and after the last, keeping 3, in ``workdir/checkpoints``).
      logging: the records, progress bar and writers; ``None``: ``Logging()`` (a
        record every 10 steps, with a progress bar).
      dispatch: steps queued at once and profiled steps; ``None``: ``Dispatch()``
        (``default_max_in_flight(mesh)`` steps, no profile).
      hooks: called at log, evaluation and checkpoint boundaries with a ``Boundary``;
        one returning ``True`` stops the run after saving (``EarlyStopping``).
      start_step: where a run with no checkpoint in ``workdir`` starts. ``None`` (the
        default): at ``state.step``, so a state that trained elsewhere (imported,
        restored by hand, or returned by another ``fit``) continues from its own step:
        records, checkpoint names and logged learning rates count on from it, and the
        pipeline continues at batch ``state.step``, where an uninterrupted run would
        be. ``num_steps`` is always the total, so a state at step 200 trained to
        ``num_steps=240`` takes 40 more steps. An int overrides ``state.step`` (an
        ensemble whose members are at different steps). A checkpoint in ``workdir``
        overrides both.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp, optax, meshkit
        >>> from meshkit import data, models, train
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> sharding = meshkit.batch_sharding(mesh)
        >>> model = train.linen_model(models.MnistCNN(), jnp.zeros((1, 8, 8, 1)))
        >>> state = train.create_train_state(model, optax.sgd(0.05), mesh, seed=0)
        >>> step = train.make_train_step(
        ...     train.classification_loss, train.state_shardings_of(state), sharding
        ... )
        >>> result = fit(
        ...     state,
        ...     step,
        ...     data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding),
        ...     num_steps=4,
        ...     workdir=tempfile.mkdtemp(),
        ...     checkpoints=Checkpoints(every=2, keep=1),
        ...     logging=Logging(every=2, progress=False),
        ... )
        >>> result.step, result.train_step_compiles
        (4, 1)
    """
    checkpoints = checkpoints or Checkpoints()
    logging = logging or Logging()
    dispatch = dispatch or Dispatch()
    _check_steps(num_steps, pipeline, train_step)
    mesh = pipeline.sharding.mesh
    assert isinstance(mesh, Mesh)
    window: InFlight[Dispatched] = dispatch.window(mesh)
    with claimed(workdir, writes=FIT_FILES) as folder:
        checkpointer = checkpoints.checkpointer(folder)
        resumed = _resume(checkpointer, state, say=logging.progress)
        data_state = None if resumed is None else resumed.data
        if data_state is None:
            first = state_step(state) if start_step is None else start_step
            _check_start(first, num_steps, given=start_step is not None)
            if first:
                data_state = {"step": first, **pipeline.state_fields()}
        state = state if resumed is None else resumed.state
        start = 0 if data_state is None else int(data_state["step"])
        records, bar = _open_records(logging, folder, checkpointer, start, num_steps)
        profiler = StepProfiler(dispatch.profile_steps, folder / "profile")
        profiler.check_run(start, num_steps)
        setting = dispatch.steps_per_dispatch
        setting = 1 if setting == "auto" and not hasattr(train_step, "trace") else setting
        steps_runner = runner(
            train_step,
            pipeline,
            data_state,
            mesh,
            largest=_largest(setting, checkpoints, evaluation),
            chunked=setting != 1,
        )
        watcher = PreemptionWatcher()
        loop = _Loop(
            state,
            records,
            steps_runner,
            evaluation,
            window,
            log_every=logging.every,
            hooks=hooks,
            stall=StallWatch(dispatch.stall_timeout),
            segment=_Segments(checkpoints, evaluation, num_steps, watcher, checkpointer, profiler),
            start=start,
        )
        began = time.perf_counter()
        try:
            with count_compiles() as compiles:
                calibration = _calibrate(loop) if setting == "auto" else None
                steps_per_dispatch = setting if calibration is None else choose_steps(calibration)
                steps_per_dispatch = 1 if steps_per_dispatch == "auto" else steps_per_dispatch
                loop.run(steps_per_dispatch, num_steps)
                if start >= num_steps and evaluation is not None:
                    loop.evaluate(loop.step)
            checkpointer.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, saying where, without a traceback
            with contextlib.suppress(Exception):  # through JAX's compiler or the loop's internals
                checkpointer.wait()  # a save under way finishes, and counts
            raise KeyboardInterrupt(_interrupted(loop, checkpointer)) from None
        finally:
            loop.stall.close()
            profiler.stop(loop.state)
            steps_runner.feed.close()
            watcher.close()
            bar.close()
            records.close()
            checkpointer.close()
        return _result(
            loop,
            start=start,
            resumed_from=None if resumed is None else resumed.step,
            wall=time.perf_counter() - began,
            train_step_compiles=compiles.count(getattr(train_step, "__name__", "train_step")),
            dispatch=describe_dispatch(steps_per_dispatch, calibration, auto=setting == "auto"),
            steps_per_dispatch=steps_per_dispatch,
            calibration=calibration,
        )


def _largest(setting: int | str, checkpoints: Checkpoints, evaluation: Evaluation | None) -> int:
    """The most steps one dispatch can run: ``setting``, or at least the probe ``'auto'``
    would time, so that a run given ``'auto'``'s choice runs the same program."""
    period = boundary_period(checkpoints.every, evaluation.every if evaluation else None)
    return max(1 if setting == "auto" else int(setting), probe_steps(period))


def _calibrate(loop: _Loop) -> Calibration | None:
    """``'auto'``'s measurement, on the run's first steps: the first step (it compiles),
    a timed group of one-step dispatches, then, after a chunk of ``probe_steps`` that
    warms up, a timed chunk, a second one-step group and a second chunk; the least of
    each two is what counts. The chunk runs the program already compiled (a counted
    loop); an unrolled chunk (convolutions on CPUs), whose compile grows with its
    steps, is never timed. ``None`` where the run ends (or stops) before the one-step
    group is timed.

    Timed groups lie inside one segment between boundaries, so no save or evaluation
    is timed with them. With several processes every one decides from the slowest
    figures (a chunk size chosen apart would pair one process's chunk program with
    another's single steps, whose collectives do not match).
    """
    loop.run(1, loop.step + 1)
    timed = loop.timed(1, min(TIMED_STEPS, loop.segment.period))
    if timed is None:
        return None
    kind = loop.runner.loop
    measured = _agreed(Calibration(timed, probe_steps(loop.segment.period), loop=kind))
    if kind == "unrolled" or measured.probe_steps == 1:
        return measured
    if loop.timed(measured.probe_steps, 1) is None:  # the probe's first chunk compiles
        return measured
    # Then chunk, one-step group, chunk: each the least of two turns, so a pause of the
    # host during one turn (a busy core) does not decide.
    chunks = [loop.timed(measured.probe_steps, 1)]
    again = loop.timed(1, min(TIMED_STEPS, loop.segment.period))
    chunks.append(loop.timed(measured.probe_steps, 1))
    if again is None or None in chunks:
        return measured
    chunk = min(c for c in chunks if c is not None)
    return _agreed(dataclasses.replace(measured, one=min(timed, again), chunk=chunk))


def _agreed(measured: Calibration) -> Calibration:
    """``measured`` as the slowest process measured it; this process's own where it is
    the only one."""
    if jax.process_count() == 1:
        return measured
    mine = np.asarray([measured.one, measured.chunk or 0.0])
    slowest = np.asarray(multihost_utils.process_allgather(mine)).max(axis=0)
    chunk = None if measured.chunk is None else float(slowest[1])
    return dataclasses.replace(measured, one=float(slowest[0]), chunk=chunk)


def _interrupted(loop: _Loop, checkpointer: Checkpointer) -> str:
    """What a second Ctrl-C stopped, and where a rerun resumes."""
    during = (
        "during the first step (which compiles the train step)"
        if loop.first_step_pending
        else "without saving it"
    )
    latest = checkpointer.latest_step()
    resume = (
        f"rerun the same command to resume from step {latest}, the newest checkpoint in "
        f"{checkpointer.directory}"
        if latest is not None
        else "there is no checkpoint yet, so a rerun starts over"
    )
    return f"A second Ctrl-C stopped training at step {loop.at}, {during}; {resume}."


def state_step(state: Any) -> int:
    """The step ``state`` has reached: its ``step`` (0 without one); one value for all members.

    Raises:
      ValueError: the members of an ensemble state are at different steps.
    """
    step = getattr(state, "step", None)
    if step is None:
        return 0
    steps = np.unique(np.asarray(to_host(step)))
    if steps.size != 1:
        raise ValueError(
            f"The state's members are at different steps {steps.tolist()}: fit cannot tell "
            "where the run continues. Pass start_step= (the pipeline step to continue at)."
        )
    return int(steps[0])


def _check_start(first: int, num_steps: int, *, given: bool) -> None:
    if 0 <= first <= num_steps:
        return
    if given:
        raise ValueError(f"start_step must be between 0 and num_steps={num_steps}, got {first!r}.")
    raise ValueError(
        f"The state has already taken {first} steps (state.step), more than num_steps="
        f"{num_steps}: num_steps counts from the start of the run, so to train 40 more "
        f"steps pass num_steps={first + 40}."
    )


def _resume(checkpointer: Checkpointer, state: TrainState, *, say: bool) -> Restored | None:
    """The newest intact checkpoint restored into ``state``'s layout (``None``: none),
    said in a line where ``say``. The checkpoint digest starts compiling first, for the
    restore's check and the run's saves, while the checkpoint is read or the step compiles."""
    checkpointer.prepare(state)
    resumed = checkpointer.resume(state)
    if resumed is not None and say and jax.process_index() == 0:
        print(f"Resumed from step {resumed.step} ({checkpointer.directory})", flush=True)
    return resumed


def _check_steps(num_steps: int, pipeline: TrainPipeline, train_step: Any) -> None:
    microbatches = getattr(train_step, "microbatches", 1)  # make_train_step's, when known
    if microbatches > 1:
        check_microbatch_rows(
            pipeline.global_batch_size,
            microbatches,
            pipeline.sharding,
            what="The pipeline's global batch has",
        )
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}.")
    if pipeline.num_steps is not None and pipeline.num_steps < num_steps:
        raise ValueError(
            f"The pipeline has {pipeline.num_steps} steps but fit needs {num_steps}; "
            "pass num_epochs=None for an endless pipeline."
        )


def _open_records(
    logging: Logging, workdir: epath.Path, checkpointer: Checkpointer, start: int, num_steps: int
) -> tuple[Records, tqdm]:
    """The run's records (``metrics.jsonl`` and ``logging.writers``) and its progress bar."""
    bar = tqdm(
        total=num_steps,
        initial=start,
        unit="step",
        disable=not logging.progress or jax.process_index() != 0,
    )
    writers = [JsonlWriter(workdir / "metrics.jsonl"), *logging.writers]
    records = Records(writers, bar, checkpointer, logging.learning_rate)
    try:
        records.start(start)  # a resumed run drops the records after its checkpoint
    except OSError as error:
        if not disk_full(error):
            raise
        bar.close()
        raise OSError(
            error.errno,
            f"Rewriting the records in {workdir} failed: no space left on device (or the "
            "disk quota is exceeded). Free space on that file system, then rerun the same "
            f"command to resume from step {start}.",
        ) from None
    return records, bar


def _result(
    loop: _Loop,
    *,
    start: int,
    resumed_from: int | None,
    wall: float,
    train_step_compiles: int,
    dispatch: str,
    steps_per_dispatch: int,
    calibration: Calibration | None,
) -> FitResult:
    """The run's ``FitResult``: its state, step, records and timings."""
    feed = loop.runner.feed
    timed_steps = loop.step - start - 1  # the first step of a run includes its compilation
    return FitResult(
        state=loop.state,
        step=loop.step,
        resumed_from=resumed_from,
        preempted=loop.preempted,
        stopped_early=loop.stop_requested,
        train_metrics=loop.records.last,
        eval_metrics=loop.eval_metrics,
        steps_per_second=timed_steps / loop.elapsed if min(timed_steps, loop.elapsed) > 0 else 0.0,
        input_wait_fraction=feed.wait_seconds / max(wall - feed.startup_seconds, 1e-9),
        input_startup_seconds=feed.startup_seconds,
        train_step_compiles=train_step_compiles,
        max_in_flight=loop.window.limit,
        input_path=loop.runner.describe(),
        dispatch=dispatch,
        steps_per_dispatch=steps_per_dispatch,
        calibration=calibration,
    )


@dataclasses.dataclass(frozen=True)
class _Segments:
    """Where a run's boundaries fall (checkpoints, evaluations, its end), and what is
    checked at every dispatch's end (preemption, a failed save)."""

    checkpoints: Checkpoints
    evaluation: Evaluation | None
    num_steps: int
    watcher: PreemptionWatcher
    checkpointer: Checkpointer
    profiler: StepProfiler

    @property
    def period(self) -> int:
        """The steps between boundaries that recur."""
        every = self.evaluation.every if self.evaluation is not None else None
        return boundary_period(self.checkpoints.every, every)

    def room(self, step: int) -> int:
        """Steps from ``step`` to the next checkpoint, evaluation or the last step."""
        stop = min(self.num_steps, (step // self.checkpoints.every + 1) * self.checkpoints.every)
        if self.evaluation is not None and self.evaluation.every:
            stop = min(stop, (step // self.evaluation.every + 1) * self.evaluation.every)
        return stop - step


class _Loop:
    """The steps of one ``fit`` call: a bounded window of queued dispatches, reads at
    boundaries."""

    def __init__(
        self,
        state: TrainState,
        records: Records,
        runner: StepProgram | PlainSteps,
        evaluation: Evaluation | None,
        window: InFlight[Dispatched],
        *,
        log_every: int,
        hooks: Sequence[Hook],
        stall: StallWatch,
        segment: _Segments,
        start: int,
    ):
        self.state = state
        self.stall = stall
        self.records = records
        self.runner = runner
        self.evaluation = evaluation
        self.window = window
        self.log_every = log_every
        self.hooks = tuple(hooks)
        self.segment = segment
        self.step = start  # the last step taken
        self.eval_metrics: dict[str, float] = {}
        self.preempted = False
        self.at = 0  # the first step of the dispatch being taken (or compiled)
        self.stop_requested = False  # a hook asked to stop
        self.elapsed = 0.0  # training time after the first step, up to the last boundary
        self._paused = 0.0  # evaluation and checkpoint time, left out of ``elapsed``
        self._first_done = 0.0
        self._lines: LogLines | None = None  # known once the first dispatch is traced
        self._checked = start  # the last step reported to the preemption watcher
        self._drained_at: float | None = None  # when the last boundary found every step done

    @property
    def stopped(self) -> bool:
        """Whether the run ended early: preempted, or a hook asked it to stop."""
        return self.preempted or self.stop_requested

    def run(self, steps_per_dispatch: int, until: int) -> None:
        """Runs steps up to ``until`` (at most the run's last), ``steps_per_dispatch`` per
        dispatch, cut at every checkpoint and evaluation boundary (where fewer steps are
        left before one, one per dispatch); preemption, a failed save and a hook's stop
        are checked after each dispatch."""
        segment = self.segment
        until = min(until, segment.num_steps)
        while self.step < until and not self.stopped:
            room = min(segment.room(self.step), until - self.step)
            steps = steps_per_dispatch if room >= steps_per_dispatch else 1
            self._dispatch(steps, steps_per_dispatch)
            step = self.step
            last = step == segment.num_steps
            evaluate = self.evaluation is not None and self.evaluation.due(step, last=last)
            self.preempted = segment.watcher.reached(step, steps=step - self._checked)
            self._checked = step
            segment.checkpointer.check(step)  # a save that failed in the background stops it
            save = segment.checkpoints.due(step, last=last, stopping=self.stopped)
            if save or evaluate:
                self._boundary(step, segment.checkpointer if save else None, evaluate=evaluate)
            if self.stop_requested and not save:  # a hook at this boundary: save here
                self._boundary(step, segment.checkpointer, evaluate=False)

    def timed(self, steps_per_dispatch: int, dispatches: int) -> float | None:
        """Runs ``dispatches`` dispatches of ``steps_per_dispatch`` steps inside one
        segment, after running up to the next boundary where this one has too little
        room left; returns their seconds per step (wall, up to the devices' last
        step), or ``None`` where the run ended or stopped first. A boundary the group
        ends at is not timed."""
        steps = steps_per_dispatch * dispatches
        if self.segment.room(self.step) < steps:
            self.run(1, self.step + self.segment.room(self.step))
        if self.stopped or self.segment.room(self.step) < steps:
            return None
        jax.block_until_ready(self.state)
        began, self._drained_at = time.perf_counter(), None
        self.run(steps_per_dispatch, self.step + steps)
        if self._drained_at is None:  # no boundary: wait for the devices here
            jax.block_until_ready(self.state)
            self._drained_at = time.perf_counter()
        return (self._drained_at - began) / steps

    def _dispatch(self, steps: int, chunk: int) -> None:
        """Queues steps ``step + 1 .. step + steps`` as one dispatch, of a run of ``chunk``
        steps per dispatch (the first one of the run compiles, and is waited for)."""
        runner, profiler = self.runner, self.segment.profiler
        first = self.step + 1
        self.at = first
        profiler.before(first, first + steps - 1)
        with jax.profiler.StepTraceAnnotation("train", step_num=first):
            compiling = self._lines is None
            if not compiling:
                self.stall.enter("input", first)
            inputs = runner.fetch(steps, chunk)
            if not compiling:
                self.stall.enter("devices", first)
            self.state, dispatched = runner.dispatch(self.state, inputs, first, steps)
            if compiling:
                jax.block_until_ready(dispatched.rows)  # the first step includes the compile
                self._first_done = time.perf_counter()
                self._lines = LogLines(runner.layout, self.log_every)
        self.step += steps
        profiler.after(self.step, self.state)
        for done in self.window.push(dispatched, dispatched.rows):
            self._settle(done)

    @property
    def first_step_pending(self) -> bool:
        """Whether the first step (with the compilation) has not finished yet."""
        return self._first_done == 0.0

    def _boundary(self, step: int, checkpointer: Checkpointer | None, *, evaluate: bool) -> None:
        """Checks every step so far, then saves and/or evaluates the state after ``step``."""
        assert self._lines is not None
        for done in self.window.drain():
            self._settle(done)
        if self._lines.pending:
            self._record(self._lines.flush(step))
        self._drained_at = time.perf_counter()  # every step so far is done
        self.stall.pause()  # saves and evaluations may take long; the next step re-arms
        done = time.perf_counter()
        self.elapsed = done - self._first_done - self._paused
        if checkpointer is not None:
            checkpointer.save(step, self.state, self.runner.feed.state(), force=True)
            self._call_hooks("checkpoint", step, {})
        if evaluate:
            self.evaluate(step)
        self._paused += time.perf_counter() - done

    def _settle(self, done: Dispatched) -> None:
        """Reads a finished dispatch's metrics, and records (and checks) the log lines
        they close."""
        assert self._lines is not None
        for read in self._lines.add(done.read(), done.first):
            self._record(read)

    def _record(self, read: IntervalRead) -> None:
        values = self.records.interval(
            read,
            paused=self._paused,
            input_wait=self.runner.feed.wait_seconds,
            diagnose=self._diagnose,
        )
        self._call_hooks("log", read.last, values)

    def _diagnose(self, step: int) -> str | None:
        """The cause of step ``step``'s non-finite loss, when a label explains it (the
        step read the batch of data step ``step - 1``)."""
        return labels_outside_classes(self.state, self.runner.feed.pipeline, step - 1)

    def evaluate(self, step: int) -> None:
        assert self.evaluation is not None
        self.eval_metrics = self.evaluation.run(self.state)
        self.records.write(step, {f"eval/{k}": v for k, v in self.eval_metrics.items()})
        self._call_hooks("eval", step, self.eval_metrics)

    def _call_hooks(self, kind: BoundaryKind, step: int, metrics: dict[str, Any]) -> None:
        """Calls every hook (all of them, even after one asks to stop)."""
        boundary = Boundary(kind, step, metrics)
        for hook in self.hooks:
            if hook(boundary):
                self.stop_requested = True
