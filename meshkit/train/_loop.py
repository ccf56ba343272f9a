"""The fit loop: steps queued ahead, metrics summed on the device, the host at boundaries only."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from tqdm import tqdm

from meshkit._compiles import count_compiles
from meshkit._inflight import InFlight, default_max_in_flight
from meshkit._paths import PathLike, as_path
from meshkit._types import Batch, Metrics, PerExampleFn
from meshkit.data import EvalPipeline, GlobalBatchIterator, TrainPipeline
from meshkit.evaluate import full_eval
from meshkit.train._checkpoint import Checkpointer, abstract_like
from meshkit.train._hooks import Boundary, BoundaryKind, Hook
from meshkit.train._interval import (
    Interval,
    MetricLayout,
    accumulating_step,
    interval_update,
    read_interval,
    zero_interval,
)
from meshkit.train._preemption import PreemptionWatcher
from meshkit.train._profile import StepProfiler
from meshkit.train._records import LearningRate, NonFiniteLossError, Records
from meshkit.train._state import TrainState
from meshkit.train._step import classification_metrics
from meshkit.train._writers import JsonlWriter, MetricWriter

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
      max_in_flight: the most steps that were queued on the devices at once.
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


def fit(
    state: TrainState,
    train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]],
    pipeline: TrainPipeline,
    *,
    num_steps: int,
    workdir: PathLike,
    eval_pipeline: EvalPipeline | None = None,
    eval_every: int | None = None,
    per_example_fn: PerExampleFn = classification_metrics,
    checkpoint_every: int = 100,
    keep_checkpoints: int = 3,
    log_every: int = 10,
    progress: bool = True,
    max_in_flight: int | None = None,
    writers: Sequence[MetricWriter] = (),
    hooks: Sequence[Hook] = (),
    learning_rate: LearningRate | None = None,
    profile_steps: tuple[int, int] | None = None,
    checkpoint_dir: PathLike | None = None,
) -> FitResult:
    """Trains ``state`` for ``num_steps`` steps, resuming from ``workdir`` if it holds a checkpoint.

    The host never waits for a step to finish before queuing the next: up to
    ``max_in_flight`` steps are queued on the devices, input batches are placed on
    them ahead of use by a background thread, and the step's metrics are summed on
    the device. The host reads them once per ``log_every`` steps (one interval late,
    so even that read does not stall the queue) and at evaluation, checkpoint and
    preemption boundaries, where it also checks that no step's loss or gradient norm
    was non-finite: a checkpoint is never written from a state that followed a
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
        program with the metric sums, and donates the state when the step does.
      pipeline: the training data.
      num_steps: total steps, counted from the start of the run (not of this resume).
      workdir: where checkpoints, ``metrics.jsonl`` and profiles go: a local folder
        or an object-store URI (``gs://bucket/run``; see ``etils.epath``).
      eval_pipeline: evaluated every ``eval_every`` steps and at the end.
      eval_every: evaluation period in steps (default: only at the end).
      per_example_fn: per-example metrics for evaluation.
      checkpoint_every: save period in steps (the last step is always saved).
      keep_checkpoints: how many checkpoints to keep.
      log_every: steps per ``metrics.jsonl`` line (each line holds the means over the
        steps since the previous line) and per progress bar update.
      progress: show a progress bar (process 0 only).
      max_in_flight: the most steps queued on the devices at once; by default
        ``default_max_in_flight(mesh)`` (1 on CPU devices, 3 on GPUs and TPUs).
      writers: more places for the records beside ``metrics.jsonl`` (process 0
        writes): ``TensorBoardWriter``, ``WandbWriter`` or any ``MetricWriter``.
      hooks: called at log, evaluation and checkpoint boundaries with a ``Boundary``;
        one returning ``True`` stops the run after saving (``EarlyStopping``).
      learning_rate: the optimizer's schedule (or constant rate), recorded as
        ``learning_rate`` in each training record.
      profile_steps: ``(first_step, count)``: a ``jax.profiler`` trace of those
        steps in ``workdir/profile/process_<i>``.
      checkpoint_dir: where checkpoints go instead of ``workdir/checkpoints``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}.")
    if log_every < 1:
        raise ValueError(f"log_every must be >= 1, got {log_every}.")
    if pipeline.num_steps is not None and pipeline.num_steps < num_steps:
        raise ValueError(
            f"The pipeline has {pipeline.num_steps} steps but fit needs {num_steps}; "
            "pass num_epochs=None for an endless pipeline."
        )
    mesh = pipeline.sharding.mesh
    assert isinstance(mesh, Mesh)
    window: InFlight[_Queued] = InFlight(
        default_max_in_flight(mesh) if max_in_flight is None else max_in_flight
    )
    workdir = as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(
        workdir / "checkpoints" if checkpoint_dir is None else checkpoint_dir,
        save_every=checkpoint_every,
        keep=keep_checkpoints,
    )
    resumed = checkpointer.resume(abstract_like(state))  # the newest intact checkpoint
    resumed_from = data_state = None
    if resumed is not None:
        state, data_state, resumed_from = resumed.state, resumed.data, resumed.step
    start = 0 if data_state is None else int(data_state["step"])
    evaluator = None
    if eval_pipeline is not None:
        evaluator = _Evaluator(per_example_fn, eval_pipeline, eval_every)
    bar = tqdm(
        total=num_steps,
        initial=start,
        unit="step",
        disable=not progress or jax.process_index() != 0,
    )
    profiler = StepProfiler(profile_steps, workdir / "profile")
    records = Records(
        [JsonlWriter(workdir / "metrics.jsonl"), *writers], bar, checkpointer, learning_rate
    )
    records.start(start)
    batches = GlobalBatchIterator(pipeline, state=data_state)
    watcher = PreemptionWatcher()
    loop = _Loop(state, records, batches, evaluator, window, log_every=log_every, hooks=hooks)
    began = time.perf_counter()
    try:
        with count_compiles() as compiles:
            step = loop.run(
                train_step,
                mesh,
                watcher,
                checkpointer,
                profiler=profiler,
                start=start,
                num_steps=num_steps,
            )
        checkpointer.wait()
    finally:
        profiler.stop(loop.state)
        batches.close()
        watcher.close()
        bar.close()
        records.close()
        checkpointer.close()
    wall = time.perf_counter() - began
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
        train_step_compiles=compiles.count(getattr(train_step, "__name__", "train_step")),
        max_in_flight=window.limit,
    )


@dataclasses.dataclass
class _Evaluator:
    per_example_fn: PerExampleFn
    pipeline: EvalPipeline
    every: int | None

    def due(self, step: int, last: bool) -> bool:
        return last or bool(self.every and step % self.every == 0)

    def __call__(self, state: TrainState) -> dict[str, float]:
        result = full_eval(self.per_example_fn, state, self.pipeline)
        return {"count": result.count, **result.metrics}


@dataclasses.dataclass
class _Queued:
    """A step queued on the devices: its running interval, and whether it closes a log line."""

    step: int
    interval: Interval
    closes_log: bool


class _Loop:
    """The steps of one ``fit`` call: a bounded window of queued steps, reads at boundaries."""

    def __init__(
        self,
        state: TrainState,
        records: Records,
        batches: GlobalBatchIterator,
        evaluator: _Evaluator | None,
        window: InFlight[_Queued],
        *,
        log_every: int,
        hooks: Sequence[Hook],
    ):
        self.state = state
        self.records = records
        self.batches = batches
        self.evaluator = evaluator
        self.window = window
        self.log_every = log_every
        self.hooks = tuple(hooks)
        self.eval_metrics: dict[str, float] = {}
        self.preempted = False
        self.stop_requested = False  # a hook asked to stop
        self.elapsed = 0.0  # training time after the first step, up to the last boundary
        self._paused = 0.0  # evaluation and checkpoint time, left out of ``elapsed``
        self._first_done = 0.0
        self._layout: MetricLayout | None = None

    def _first_step(
        self, train_step: Callable[..., Any], mesh: Mesh, batch: Batch
    ) -> tuple[Callable[..., Any], Interval, Interval]:
        """Runs the first step; returns the step to use from now on, the interval, and zeros.

        A jitted train step is traced (not run) for its metric names and donation, and
        fused with the metric sums into one program. A plain Python step runs as it
        is, and a second small program adds its metrics.
        """
        if not hasattr(train_step, "trace"):
            self.state, metrics = train_step(self.state, batch)
            self._layout = MetricLayout.of(metrics)
            update = interval_update(self._layout, mesh)
            zeros = zero_interval(self._layout, mesh)

            def unfused(state: Any, batch: Batch, interval: Interval) -> tuple[Any, Interval]:
                state, metrics = train_step(state, batch)
                return state, update(interval, metrics)

            return unfused, update(zeros, metrics), zeros
        traced = train_step.trace(self.state, batch)  # pyright: ignore[reportFunctionMemberAccess]
        self._layout = MetricLayout.of(traced.out_info[1])
        donated = any(info.donated for info in jax.tree.leaves(traced.args_info[0][0]))
        shardings = jax.tree.map(lambda leaf: leaf.sharding, self.state)
        fused = accumulating_step(train_step, self._layout, shardings, mesh, donate_state=donated)
        zeros = zero_interval(self._layout, mesh)
        self.state, interval = fused(self.state, batch, zeros)
        return fused, interval, zeros

    def run(
        self,
        train_step: Callable[..., Any],
        mesh: Mesh,
        watcher: PreemptionWatcher,
        checkpointer: Checkpointer,
        *,
        profiler: StepProfiler,
        start: int,
        num_steps: int,
    ) -> int:
        """Runs steps ``start + 1 .. num_steps``; returns the last step taken."""
        step = start
        step_fn = zeros = interval = None
        for step in range(start + 1, num_steps + 1):
            profiler.before(step)
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                batch = next(self.batches)
                if step_fn is None or zeros is None or interval is None:
                    step_fn, interval, zeros = self._first_step(train_step, mesh, batch)
                    jax.block_until_ready(interval)  # the first step includes the compilation
                    self._first_done = time.perf_counter()
                else:
                    self.state, interval = step_fn(self.state, batch, interval)
            profiler.after(step, self.state)
            last = step == num_steps
            evaluate = self.evaluator is not None and self.evaluator.due(step, last)
            self.preempted = watcher.reached(step)
            stop = self.preempted or self.stop_requested
            save = last or stop or checkpointer.should_save(step)
            if save or evaluate:
                self._boundary(step, interval, checkpointer if save else None, evaluate=evaluate)
                interval = zeros
                if stop:
                    break
                continue
            closes_log = step % self.log_every == 0
            if closes_log:
                for leaf in interval:
                    leaf.copy_to_host_async()  # read one interval late, when it is ready
            for queued in self.window.push(_Queued(step, interval, closes_log), interval.steps):
                self._settle(queued)
            if closes_log:
                interval = zeros
        if start >= num_steps and self.evaluator is not None:
            self.evaluate(step)
        return step

    def _boundary(
        self,
        step: int,
        interval: Interval,
        checkpointer: Checkpointer | None,
        *,
        evaluate: bool,
    ) -> None:
        """Checks every step so far, then saves and/or evaluates the state after ``step``."""
        for queued in self.window.drain():
            self._settle(queued)
        self._settle(_Queued(step, interval, closes_log=True))
        done = time.perf_counter()
        self.elapsed = done - self._first_done - self._paused
        if checkpointer is not None:
            checkpointer.save(step, self.state, self.batches.state(), force=True)
            self._call_hooks("checkpoint", step, {})
        if evaluate:
            self.evaluate(step)
        self._paused += time.perf_counter() - done

    def _settle(self, queued: _Queued) -> None:
        """Reads (and checks) a finished step's interval if it closes a log line."""
        if queued.closes_log:
            assert self._layout is not None
            read = read_interval(self._layout, queued.interval, queued.step)
            values = self.records.interval(
                read, paused=self._paused, input_wait=self.batches.wait_seconds
            )
            self._call_hooks("log", queued.step, values)

    def evaluate(self, step: int) -> None:
        assert self.evaluator is not None
        self.eval_metrics = self.evaluator(self.state)
        self.records.write(step, {f"eval/{k}": v for k, v in self.eval_metrics.items()})
        self._call_hooks("eval", step, self.eval_metrics)

    def _call_hooks(self, kind: BoundaryKind, step: int, metrics: dict[str, Any]) -> None:
        """Calls every hook (all of them, even after one asks to stop)."""
        boundary = Boundary(kind, step, metrics)
        for hook in self.hooks:
            if hook(boundary):
                self.stop_requested = True
