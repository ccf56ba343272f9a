"""The fit loop: one step in flight, metrics one step late, checkpoints, evaluation, preemption."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from meshkit._compiles import count_compiles
from meshkit._host import to_host
from meshkit.data import EvalPipeline, GlobalBatchIterator, TrainPipeline
from meshkit.evaluate import full_eval
from meshkit.train._checkpoint import Checkpointer, PreemptionWatcher, abstract_like
from meshkit.train._state import TrainState
from meshkit.train._step import Batch, Metrics, PerExampleFn, classification_metrics


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
      train_metrics: the last step's metrics.
      eval_metrics: the last evaluation (``count`` plus metric means), or ``{}``.
      steps_per_second: training throughput after the first step of this run.
      input_wait_fraction: the share of this run's time spent waiting for input batches.
      train_step_compiles: compilations of the train step during this run.
    """

    state: TrainState
    step: int
    resumed_from: int | None
    preempted: bool
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    steps_per_second: float
    input_wait_fraction: float
    train_step_compiles: int


class _Log:
    """Host-side bookkeeping of metrics that arrive one step late (process 0 writes)."""

    def __init__(self, workdir: Path, bar: tqdm, checkpointer: Checkpointer, every: int):
        self.every = every
        self.path = workdir / "metrics.jsonl"
        self.bar = bar
        self.checkpointer = checkpointer
        self.write = jax.process_index() == 0
        self.last: dict[str, float] = {}

    def train(self, step: int, metrics: Metrics, *, force: bool = False) -> None:
        host = {name: float(value) for name, value in to_host(metrics).items()}
        self.last = host
        bad = {name: host[name] for name in ("loss", "grad_norm") if not math.isfinite(host[name])}
        if bad:
            latest = self.checkpointer.latest_step()
            kept = f"step {latest} in {self.checkpointer.directory}" if latest else "none"
            raise NonFiniteLossError(
                f"Training stopped at step {step}: {bad} is not finite. The last good "
                f"checkpoint is kept ({kept}); no state from this step was saved. Lower the "
                "learning rate, check the data for NaNs, or add gradient clipping."
            )
        self.bar.update(1)
        if force or step % self.every == 0:
            self.bar.set_postfix(loss=f"{host['loss']:.4f}", refresh=False)
            self.record({"step": step, **host})

    def record(self, entry: Mapping[str, Any]) -> None:
        if self.write:
            with self.path.open("a") as file:
                file.write(json.dumps({**entry, "time": time.time()}) + "\n")


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
) -> FitResult:
    """Trains ``state`` for ``num_steps`` steps, resuming from ``workdir`` if it holds a checkpoint.

    At most one step is in flight: step ``k`` is dispatched, then step ``k-1``'s
    metrics are read (which also checks that they are finite). Checkpoints hold the
    train state and the data iterator's state, so a killed run restarted with the same
    arguments continues exactly where the last checkpoint left it, on any mesh. A
    SIGTERM saves at the next step boundary and returns with ``preempted=True``.

    Args:
      state: the initial train state, placed on the mesh (from ``create_train_state``);
        when resuming it is the restore target, so its shardings decide the layout.
      train_step: from ``make_train_step``.
      pipeline: the training data.
      num_steps: total steps, counted from the start of the run (not of this resume).
      workdir: where checkpoints and ``metrics.jsonl`` go.
      eval_pipeline: evaluated every ``eval_every`` steps and at the end.
      eval_every: evaluation period in steps (default: only at the end).
      per_example_fn: per-example metrics for evaluation.
      checkpoint_every: save period in steps (the last step is always saved).
      keep_checkpoints: how many checkpoints to keep.
      log_every: period of ``metrics.jsonl`` lines and progress bar updates.
      progress: show a progress bar (process 0 only).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}.")
    if pipeline.num_steps is not None and pipeline.num_steps < num_steps:
        raise ValueError(
            f"The pipeline has {pipeline.num_steps} steps but fit needs {num_steps}; "
            "pass num_epochs=None for an endless pipeline."
        )
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(
        workdir / "checkpoints", save_every=checkpoint_every, keep=keep_checkpoints
    )
    resumed_from = checkpointer.latest_step()
    data_state = None
    if resumed_from is not None:
        state, data_state = checkpointer.restore(abstract_like(state))
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
    loop = _Loop(state, train_step, _Log(workdir, bar, checkpointer, log_every), evaluator)
    batches = GlobalBatchIterator(pipeline, state=data_state)
    watcher = PreemptionWatcher()
    began = time.perf_counter()
    try:
        with count_compiles() as compiles:
            step = loop.run(batches, watcher, checkpointer, start, num_steps)
        checkpointer.wait()
    finally:
        batches.close()
        watcher.close()
        bar.close()
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


class _Loop:
    """The steps of one ``fit`` call; at most one step in flight."""

    def __init__(
        self,
        state: TrainState,
        train_step: Callable[[TrainState, Batch], tuple[TrainState, Metrics]],
        log: _Log,
        evaluator: _Evaluator | None,
    ):
        self.state = state
        self.train_step = train_step
        self.log = log
        self.evaluator = evaluator
        self.eval_metrics: dict[str, float] = {}
        self.preempted = False
        self.elapsed = 0.0

    def run(
        self,
        batches: GlobalBatchIterator,
        watcher: PreemptionWatcher,
        checkpointer: Checkpointer,
        start: int,
        num_steps: int,
    ) -> int:
        """Runs steps ``start + 1 .. num_steps``; returns the last step taken."""
        pending: tuple[int, Metrics] | None = None
        first_done = None
        step = start
        for step in range(start + 1, num_steps + 1):
            self.state, metrics = self.train_step(self.state, next(batches))
            if pending is not None:
                self.log.train(*pending)  # the previous step's metrics, read while this one runs
            pending = (step, metrics)
            first_done = first_done or time.perf_counter()
            last = step == num_steps
            evaluate = self.evaluator is not None and self.evaluator.due(step, last)
            self.preempted = watcher.reached(step)
            save = last or self.preempted or checkpointer.should_save(step)
            if save or evaluate:
                self.log.train(*pending, force=True)  # never save or evaluate unchecked state
                pending = None
            if save:
                checkpointer.save(step, self.state, batches.state(), force=True)
            if evaluate:
                self.evaluate(step)
            if self.preempted:
                break
        if start >= num_steps and self.evaluator is not None:
            self.evaluate(step)
        self.elapsed = time.perf_counter() - first_done if first_done else 0.0
        return step

    def evaluate(self, step: int) -> None:
        assert self.evaluator is not None
        self.eval_metrics = self.evaluator(self.state)
        self.log.record({"step": step, **{f"eval/{k}": v for k, v in self.eval_metrics.items()}})
