"""The fit loop: steps queued ahead, metrics summed on the device, the host at boundaries only."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
from jax.sharding import Mesh
from tqdm import tqdm

from meshkit._compiles import count_compiles
from meshkit._inflight import InFlight, default_max_in_flight
from meshkit._types import Batch, Metrics, PerExampleFn
from meshkit.data import EvalPipeline, GlobalBatchIterator, TrainPipeline
from meshkit.evaluate import full_eval
from meshkit.train._checkpoint import Checkpointer, abstract_like
from meshkit.train._interval import (
    WATCHED,
    Interval,
    IntervalRead,
    MetricLayout,
    accumulating_step,
    interval_update,
    read_interval,
    zero_interval,
)
from meshkit.train._preemption import PreemptionWatcher
from meshkit.train._state import TrainState
from meshkit.train._step import classification_metrics


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm stopped being finite; the run was stopped."""


@dataclasses.dataclass
class FitResult:
    """What ``fit`` did.

    Attributes:
      state: the final train state.
      step: the number of steps taken in all (including those before a resume).
      resumed_from: the checkpoint step the run resumed from, or ``None``.
      preempted: whether a SIGTERM stopped the run early (after saving).
      train_metrics: the means of the train step's metrics over the last log interval.
      eval_metrics: the last evaluation (``count`` plus metric means), or ``{}``.
      steps_per_second: training throughput after the first step of this run
        (evaluation and checkpoint time excluded).
      input_wait_fraction: the share of this run's time spent waiting for input batches.
      train_step_compiles: compilations of the train step during this run.
      max_in_flight: the most steps that were queued on the devices at once.
    """

    state: TrainState
    step: int
    resumed_from: int | None
    preempted: bool
    train_metrics: dict[str, Any]
    eval_metrics: dict[str, float]
    steps_per_second: float
    input_wait_fraction: float
    train_step_compiles: int
    max_in_flight: int


def _step_of(line: str) -> float:
    """The step a ``metrics.jsonl`` line records; infinite for a line cut short by a kill."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


class _Log:
    """Host-side bookkeeping of interval reads (process 0 writes ``metrics.jsonl``)."""

    def __init__(self, workdir: Path, bar: tqdm, checkpointer: Checkpointer):
        self.path = workdir / "metrics.jsonl"
        self.bar = bar
        self.checkpointer = checkpointer
        self.write = jax.process_index() == 0
        self.last: dict[str, Any] = {}
        self._file: TextIO | None = None

    def interval(self, read: IntervalRead) -> None:
        """Checks an interval for non-finite steps, then records its means."""
        if read.first_bad_step is not None:
            latest = self.checkpointer.latest_step()
            kept = (
                f"The newest checkpoint, step {latest} in {self.checkpointer.directory}, "
                "was saved before it and is kept (verified against its digest when a run "
                "resumes from it)"
                if latest is not None
                else "No checkpoint was saved before it"
            )
            watched = {name: read.means[name] for name in WATCHED if name in read.means}
            raise NonFiniteLossError(
                f"Training stopped at step {read.first_bad_step}: the loss or gradient norm "
                f"was not finite (means over steps {read.first}-{read.last}: {watched}). "
                f"{kept}; no state from step {read.first_bad_step} on was saved. Lower the "
                "learning rate, check the data for NaNs, or add gradient clipping."
            )
        self.last = read.means
        self.bar.update(read.last - self.bar.n)
        if "loss" in read.means:
            self.bar.set_postfix(loss=f"{read.means['loss']:.4f}", refresh=False)
        self.record({"step": read.last, **read.means})

    def forget_after(self, step: int) -> None:
        """Drops the lines of steps after ``step``: a resumed run logs them again."""
        if not self.write or not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) < len(lines):
            partial = self.path.with_suffix(".jsonl.tmp")
            partial.write_text("".join(kept))
            partial.replace(self.path)  # atomic: a kill here keeps one whole file

    def record(self, entry: Mapping[str, Any]) -> None:
        if not self.write:
            return
        if self._file is None:
            self._file = self.path.open("a")
        self._file.write(json.dumps({**entry, "time": time.time()}) + "\n")
        self._file.flush()  # each line is on disk when written: a killed run keeps it

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def fit(
    state: TrainState,
    train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]],
    pipeline: TrainPipeline,
    *,
    num_steps: int,
    workdir: str | Path,
    eval_pipeline: EvalPipeline | None = None,
    eval_every: int | None = None,
    per_example_fn: PerExampleFn = classification_metrics,
    checkpoint_every: int = 100,
    keep_checkpoints: int = 3,
    log_every: int = 10,
    progress: bool = True,
    max_in_flight: int | None = None,
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
    SIGTERM saves at the next step boundary and returns with ``preempted=True``.

    Args:
      state: the initial train state, placed on the mesh (from ``create_train_state``);
        when resuming it is the restore target, so its shardings decide the layout.
      train_step: from ``make_train_step`` (or any ``step(state, batch) -> (state,
        metrics)`` reporting ``metrics["loss"]``). ``fit`` runs it inside one jitted
        program with the metric sums, and donates the state when the step does.
      pipeline: the training data.
      num_steps: total steps, counted from the start of the run (not of this resume).
      workdir: where checkpoints and ``metrics.jsonl`` go.
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
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(
        workdir / "checkpoints", save_every=checkpoint_every, keep=keep_checkpoints
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
    batches = GlobalBatchIterator(pipeline, state=data_state)
    watcher = PreemptionWatcher()
    log = _Log(workdir, bar, checkpointer)
    if resumed_from is not None:
        log.forget_after(start)
    loop = _Loop(state, log, evaluator, window, log_every)
    began = time.perf_counter()
    try:
        with count_compiles() as compiles:
            step = loop.run(
                train_step, mesh, batches, watcher, checkpointer, start=start, num_steps=num_steps
            )
        checkpointer.wait()
    finally:
        batches.close()
        watcher.close()
        bar.close()
        log.close()
        checkpointer.close()
    wall = time.perf_counter() - began
    timed_steps = step - start - 1  # the first step of a run includes its compilation
    return FitResult(
        state=loop.state,
        step=step,
        resumed_from=resumed_from,
        preempted=loop.preempted,
        train_metrics=loop.log.last,
        eval_metrics=loop.eval_metrics,
        steps_per_second=timed_steps / loop.elapsed if min(timed_steps, loop.elapsed) > 0 else 0.0,
        input_wait_fraction=batches.wait_seconds / wall if wall > 0 else 0.0,
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
        log: _Log,
        evaluator: _Evaluator | None,
        window: InFlight[_Queued],
        log_every: int,
    ):
        self.state = state
        self.log = log
        self.evaluator = evaluator
        self.window = window
        self.log_every = log_every
        self.eval_metrics: dict[str, float] = {}
        self.preempted = False
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
        batches: GlobalBatchIterator,
        watcher: PreemptionWatcher,
        checkpointer: Checkpointer,
        *,
        start: int,
        num_steps: int,
    ) -> int:
        """Runs steps ``start + 1 .. num_steps``; returns the last step taken."""
        step = start
        step_fn = zeros = interval = None
        for step in range(start + 1, num_steps + 1):
            batch = next(batches)
            if step_fn is None or zeros is None or interval is None:
                step_fn, interval, zeros = self._first_step(train_step, mesh, batch)
                jax.block_until_ready(interval)  # the first step includes the compilation
                self._first_done = time.perf_counter()
            else:
                self.state, interval = step_fn(self.state, batch, interval)
            last = step == num_steps
            evaluate = self.evaluator is not None and self.evaluator.due(step, last)
            self.preempted = watcher.reached(step)
            save = last or self.preempted or checkpointer.should_save(step)
            if save or evaluate:
                self._boundary(step, interval, (checkpointer, batches) if save else None, evaluate)
                interval = zeros
                if self.preempted:
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
        save: tuple[Checkpointer, GlobalBatchIterator] | None,
        evaluate: bool,
    ) -> None:
        """Checks every step so far, then saves and/or evaluates the state after ``step``."""
        for queued in self.window.drain():
            self._settle(queued)
        self._settle(_Queued(step, interval, closes_log=True))
        done = time.perf_counter()
        self.elapsed = done - self._first_done - self._paused
        if save is not None:
            checkpointer, batches = save
            checkpointer.save(step, self.state, batches.state(), force=True)
        if evaluate:
            self.evaluate(step)
        self._paused += time.perf_counter() - done

    def _settle(self, queued: _Queued) -> None:
        """Reads (and checks) a finished step's interval if it closes a log line."""
        if queued.closes_log:
            assert self._layout is not None
            self.log.interval(read_interval(self._layout, queued.interval, queued.step))

    def evaluate(self, step: int) -> None:
        assert self.evaluator is not None
        self.eval_metrics = self.evaluator(self.state)
        self.log.record({"step": step, **{f"eval/{k}": v for k, v in self.eval_metrics.items()}})
