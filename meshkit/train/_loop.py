"""The fit loop: steps queued ahead, metrics summed on the device, the host at boundaries only."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh
from tqdm import tqdm

from meshkit._compiles import count_compiles
from meshkit._host import to_host
from meshkit._inflight import InFlight
from meshkit._paths import PathLike, as_path, check_store_packages
from meshkit._runtime import PreemptionWatcher, StallWatch
from meshkit._types import Batch, Metrics
from meshkit.data import GlobalBatchIterator, TrainPipeline
from meshkit.train._checkpoint import Checkpointer
from meshkit.train._chunks import ChunkSizes, boundary_period
from meshkit.train._feeds import HostChunks, ResidentChunks
from meshkit.train._gradients import check_microbatch_rows
from meshkit.train._hooks import Boundary, BoundaryKind, Hook
from meshkit.train._interval import Interval, MetricLayout
from meshkit.train._label_diagnosis import labels_outside_classes
from meshkit.train._profile import StepProfiler
from meshkit.train._records import NonFiniteLossError, Records
from meshkit.train._runners import Chunked, Closed, PerStep
from meshkit.train._settings import (
    Checkpoints,
    Dispatch,
    Evaluation,
    FitSettings,
    Logging,
    resolve_deprecated,
)
from meshkit.train._state import TrainState
from meshkit.train._writers import JsonlWriter

__all__ = ["FitResult", "NonFiniteLossError", "fit"]


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
      steps_per_dispatch: the steps each whole chunk ran (1: one step per dispatch).
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
    **deprecated: Any,
) -> FitResult:
    """Trains ``state`` for ``num_steps`` steps, resuming from ``workdir`` if it holds a checkpoint.

    The host never waits for a step to finish before queuing the next: up to
    ``dispatch.max_in_flight`` steps are queued on the devices, input batches are
    placed on them ahead of use by a background thread, and the step's metrics are
    summed on the device (``MetricSums``). The host reads them once per
    ``logging.every`` steps (one interval late, so even that read does not stall the
    queue) and at evaluation, checkpoint and preemption boundaries, where it also
    checks that no step's loss or gradient norm was non-finite: a checkpoint is never
    written from a state that followed a non-finite step.

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
        program with the metric sums, and donates the state when the step does.
      pipeline: the training data.
      num_steps: total steps, counted from the start of the run (not of this resume).
      workdir: where checkpoints, ``metrics.jsonl`` and profiles go: a local folder
        or an object-store URI (``gs://bucket/run``; see ``etils.epath``).
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
      **deprecated: the keywords of earlier releases (``eval_pipeline``,
        ``eval_every``, ``per_example_fn``, ``checkpoint_every``, ``keep_checkpoints``,
        ``checkpoint_dir``, ``log_every``, ``progress``, ``writers``,
        ``learning_rate``, ``max_in_flight``, ``profile_steps``), accepted with a
        ``DeprecationWarning`` until meshkit 0.2.0 removes them (CHANGELOG.md).

    Raises:
      TypeError: an unknown keyword, or an old keyword beside the object that covers it.

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
    settings = resolve_deprecated(
        deprecated,
        {
            "evaluation": evaluation,
            "checkpoints": checkpoints,
            "logging": logging,
            "dispatch": dispatch,
        },
        valid=_PARAMETERS,
    )
    del deprecated, evaluation, checkpoints, logging, dispatch  # use settings' instead
    _check_steps(num_steps, pipeline)
    microbatches = getattr(train_step, "microbatches", 1)  # make_train_step's, when known
    if microbatches > 1:
        check_microbatch_rows(
            pipeline.global_batch_size,
            microbatches,
            pipeline.sharding,
            what="The pipeline's global batch has",
        )
    mesh = pipeline.sharding.mesh
    assert isinstance(mesh, Mesh)
    window: InFlight[_Queued] = settings.dispatch.window(mesh)
    check_store_packages(workdir)
    workdir = as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = settings.checkpoints.checkpointer(workdir)
    resumed = checkpointer.resume(state)  # the newest intact checkpoint
    data_state = None if resumed is None else resumed.data
    if data_state is None:
        first = state_step(state) if start_step is None else start_step
        _check_start(first, num_steps, given=start_step is not None)
        if first:
            data_state = {"step": first, **pipeline.state_fields()}
    state = state if resumed is None else resumed.state
    start = 0 if data_state is None else int(data_state["step"])
    records, bar = _open_records(settings.logging, workdir, checkpointer, start, num_steps)
    profiler = StepProfiler(settings.dispatch.profile_steps, workdir / "profile")
    profiler.check_run(start, num_steps)
    runner = _runner(train_step, pipeline, data_state, mesh, settings)
    sizes = ChunkSizes(
        settings.dispatch.steps_per_dispatch if runner.chunked else 1,
        boundary_period(
            settings.checkpoints.every,
            settings.evaluation.every if settings.evaluation is not None else None,
        ),
    )
    batches = runner.feed
    watcher = PreemptionWatcher()
    loop = _Loop(
        state,
        records,
        batches,
        settings.evaluation,
        window,
        log_every=settings.logging.every,
        hooks=hooks,
        stall=StallWatch(settings.dispatch.stall_timeout),
    )
    began = time.perf_counter()
    try:
        with count_compiles() as compiles:
            step = loop.run(
                runner,
                sizes,
                watcher,
                settings.checkpoints,
                checkpointer,
                profiler=profiler,
                start=start,
                num_steps=num_steps,
            )
        checkpointer.wait()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, saying where, without a traceback
        with contextlib.suppress(Exception):  # through JAX's compiler or the loop's internals
            checkpointer.wait()  # a save under way finishes, and counts
        raise KeyboardInterrupt(_interrupted(loop, checkpointer)) from None
    finally:
        loop.stall.close()
        profiler.stop(loop.state)
        batches.close()
        watcher.close()
        bar.close()
        records.close()
        checkpointer.close()
    return _result(
        loop,
        step,
        start=start,
        resumed_from=None if resumed is None else resumed.step,
        wall=time.perf_counter() - began,
        batches=batches,
        train_step_compiles=compiles.count(getattr(train_step, "__name__", "train_step")),
        input_path=runner.describe(),
        dispatch=sizes.describe(),
        steps_per_dispatch=sizes.chosen or 1,
    )


def _runner(
    train_step: Callable[..., Any],
    pipeline: TrainPipeline,
    data_state: dict[str, Any] | None,
    mesh: Mesh,
    settings: FitSettings,
) -> PerStep | Chunked:
    """One step per dispatch on host batches, or chunks (several steps, or resident data)."""
    log_every = settings.logging.every
    resident = pipeline.resident_mode is not None
    if not resident and settings.dispatch.steps_per_dispatch == 1:
        return PerStep(
            train_step, GlobalBatchIterator(pipeline, state=data_state), mesh, log_every=log_every
        )
    feed = ResidentChunks(pipeline, data_state) if resident else HostChunks(pipeline, data_state)
    return Chunked(train_step, feed, mesh, log_every=log_every)


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


def _room(
    step: int, num_steps: int, checkpoints: Checkpoints, evaluation: Evaluation | None
) -> int:
    """Steps from ``step`` to the next checkpoint, evaluation or the last step."""
    stop = min(num_steps, (step // checkpoints.every + 1) * checkpoints.every)
    if evaluation is not None and evaluation.every:
        stop = min(stop, (step // evaluation.every + 1) * evaluation.every)
    return stop - step


def _check_steps(num_steps: int, pipeline: TrainPipeline) -> None:
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
    records.start(start)
    return records, bar


def _result(
    loop: _Loop,
    step: int,
    *,
    start: int,
    resumed_from: int | None,
    wall: float,
    batches: GlobalBatchIterator | HostChunks | ResidentChunks,
    train_step_compiles: int,
    input_path: str,
    dispatch: str,
    steps_per_dispatch: int,
) -> FitResult:
    """The run's ``FitResult``: its state, step, records and timings."""
    timed_steps = step - start - 1  # the first step of a run includes its compilation
    return FitResult(
        state=loop.state,
        step=step,
        resumed_from=resumed_from,
        preempted=loop.preempted,
        stopped_early=loop.stop_requested,
        train_metrics=loop.records.last,
        eval_metrics=loop.eval_metrics,
        steps_per_second=timed_steps / loop.elapsed if min(timed_steps, loop.elapsed) > 0 else 0.0,
        input_wait_fraction=batches.wait_seconds / max(wall - batches.startup_seconds, 1e-9),
        input_startup_seconds=batches.startup_seconds,
        train_step_compiles=train_step_compiles,
        max_in_flight=loop.window.limit,
        input_path=input_path,
        dispatch=dispatch,
        steps_per_dispatch=steps_per_dispatch,
    )


_PARAMETERS = tuple(inspect.signature(fit).parameters)[:-1]  # all but **deprecated


@dataclasses.dataclass
class _Queued:
    """A dispatch queued on the devices: its last step and the log lines it closed."""

    step: int
    closed: Closed


Feed = GlobalBatchIterator | HostChunks | ResidentChunks


class _Loop:
    """The steps of one ``fit`` call: a bounded window of queued dispatches, reads at
    boundaries."""

    def __init__(
        self,
        state: TrainState,
        records: Records,
        batches: Feed,
        evaluation: Evaluation | None,
        window: InFlight[_Queued],
        *,
        log_every: int,
        hooks: Sequence[Hook],
        stall: StallWatch,
    ):
        self.state = state
        self.stall = stall
        self.records = records
        self.batches = batches
        self.evaluation = evaluation
        self.window = window
        self.log_every = log_every
        self.hooks = tuple(hooks)
        self.eval_metrics: dict[str, float] = {}
        self.preempted = False
        self.at = 0  # the first step of the dispatch being taken (or compiled)
        self.stop_requested = False  # a hook asked to stop
        self.elapsed = 0.0  # training time after the first step, up to the last boundary
        self._paused = 0.0  # evaluation and checkpoint time, left out of ``elapsed``
        self._first_done = 0.0
        self.queuing_seconds = 0.0  # host time building and queuing dispatches
        self._layout: MetricLayout | None = None

    def run(
        self,
        runner: PerStep | Chunked,
        sizes: ChunkSizes,
        watcher: PreemptionWatcher,
        checkpoints: Checkpoints,
        checkpointer: Checkpointer,
        *,
        profiler: StepProfiler,
        start: int,
        num_steps: int,
    ) -> int:
        """Runs steps ``start + 1 .. num_steps``; returns the last step taken.

        Steps go in dispatches of ``sizes``'s choosing, cut at every checkpoint and
        evaluation boundary; preemption, a failed save and a hook's stop are checked
        after each dispatch.
        """
        step = start
        interval: Interval | None = None
        pending = 0  # steps since the last log line (in ``interval``)
        began = 0.0  # when the timed group under way began
        checked = start  # the last step reported to the preemption watcher
        evaluation = self.evaluation
        while step < num_steps:
            room = _room(step, num_steps, checkpoints, evaluation)
            group = sizes.timing_group(room) if interval is not None else None
            plan = [group[1]] * group[0] if group else [1 if interval is None else sizes.next(room)]
            if group:
                jax.block_until_ready(self.state)
                began, self.queuing_seconds = time.perf_counter(), 0.0
            traced_now = interval is None  # the run's first dispatch traces the step
            dispatched = time.perf_counter()
            for steps in plan:
                interval, closed = self._dispatch(runner, interval, step, steps, profiler)
                step += steps
                pending = step - closed.at[-1][1] if closed.at else pending + steps
                if not group:
                    sizes.ran(steps)
            took = time.perf_counter() - dispatched
            if traced_now:  # waited for: its time is mostly the step's compile
                sizes.first_dispatch(
                    took,
                    unrolled=runner.unrolled,
                    key=getattr(runner, "step_key", None),
                    left=num_steps - step,
                )
            elif not group:
                sizes.dispatch_took(plan[0], took)
            if group:
                jax.block_until_ready(self.state)
                seconds = time.perf_counter() - began
                sizes.timed(sum(plan), seconds, queuing=self.queuing_seconds, left=num_steps - step)
            last = step == num_steps
            evaluate = evaluation is not None and evaluation.due(step, last=last)
            self.preempted = watcher.reached(step, steps=step - checked)
            checked = step
            stop = self.preempted or self.stop_requested
            checkpointer.check(step)  # a save that failed in the background stops the run
            save = checkpoints.due(step, last=last, stopping=stop)
            if save or evaluate:
                assert interval is not None
                carried = Closed(interval, [(None, step)] if pending else [])
                self._boundary(step, carried, checkpointer if save else None, evaluate=evaluate)
                interval, pending = runner.zeros, 0
                if stop:
                    break
        if start >= num_steps and self.evaluation is not None:
            self.evaluate(step)
        return step

    def _dispatch(
        self,
        runner: PerStep | Chunked,
        interval: Interval | None,
        step: int,
        steps: int,
        profiler: StepProfiler,
    ) -> tuple[Interval, Closed]:
        """Queues steps ``step + 1 .. step + steps`` as one dispatch (the first one of the
        run compiles, and is waited for)."""
        first = step + 1
        self.at = first
        profiler.before(first, first + steps - 1)
        with jax.profiler.StepTraceAnnotation("train", step_num=first):
            if interval is not None:
                self.stall.enter("input", first)
            queuing = time.perf_counter()
            inputs = runner.fetch(steps)
            if interval is not None:
                self.stall.enter("devices", first)
            compiling = interval is None
            self.state, interval, closed = runner.dispatch(
                self.state, interval, inputs, first, steps
            )
            self.queuing_seconds += time.perf_counter() - queuing
            if compiling:
                self._layout = runner.layout
                jax.block_until_ready(interval)  # the first step includes the compile
                self._first_done = time.perf_counter()
        profiler.after(step + steps, self.state)
        self._push(step + steps, closed, interval)
        return interval, closed

    def _push(self, step: int, closed: Closed, interval: Interval) -> None:
        """Queues a dispatch (done when its interval is); settles the ones that left the
        queue."""
        for queued in self.window.push(_Queued(step, closed), interval.steps):
            self._settle(queued)

    @property
    def first_step_pending(self) -> bool:
        """Whether the first step (with the compilation) has not finished yet."""
        return self._first_done == 0.0

    def _boundary(
        self,
        step: int,
        carried: Closed,
        checkpointer: Checkpointer | None,
        *,
        evaluate: bool,
    ) -> None:
        """Checks every step so far, then saves and/or evaluates the state after ``step``."""
        for queued in self.window.drain():
            self._settle(queued)
        self._settle(_Queued(step, carried))
        self.stall.pause()  # saves and evaluations may take long; the next step re-arms
        done = time.perf_counter()
        self.elapsed = done - self._first_done - self._paused
        if checkpointer is not None:
            checkpointer.save(step, self.state, self.batches.state(), force=True)
            self._call_hooks("checkpoint", step, {})
        if evaluate:
            self.evaluate(step)
        self._paused += time.perf_counter() - done

    def _settle(self, queued: _Queued) -> None:
        """Reads (and checks) the log lines a finished dispatch closed."""
        if not queued.closed.at:
            return
        assert self._layout is not None
        for read in queued.closed.reads(self._layout):
            values = self.records.interval(
                read,
                paused=self._paused,
                input_wait=self.batches.wait_seconds,
                diagnose=self._diagnose,
            )
            self._call_hooks("log", read.last, values)

    def _diagnose(self, step: int) -> str | None:
        """The cause of step ``step``'s non-finite loss, when a label explains it (the
        step read the batch of data step ``step - 1``)."""
        return labels_outside_classes(self.state, self.batches.pipeline, step - 1)

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
