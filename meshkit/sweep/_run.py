"""``run_sweep``: K settings trained as one program, in stages split by halving or PBT decisions."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from tqdm import tqdm

from meshkit._host import to_host
from meshkit._paths import PathLike, as_path, write_text_atomically
from meshkit._types import PerExampleFn
from meshkit._workdir import RUN_FILES, claimed
from meshkit.data import TrainPipeline
from meshkit.ensemble import (
    EnsembleLayout,
    MemberLossFn,
    MemberTrainPipeline,
    ensemble_metrics,
    per_member,
)
from meshkit.ensemble._step import ensemble_step
from meshkit.ensemble._strategy import MemberStrategy
from meshkit.evaluate import full_eval
from meshkit.sweep._definition import Sweep
from meshkit.sweep._results import SweepResult, Trial
from meshkit.sweep._schedules import Decision, Schedule, decide
from meshkit.sweep._space import SEED_NAMES, Point, Value, check_points
from meshkit.sweep._state import (
    init_keys,
    init_members,
    value_arrays,
)
from meshkit.sweep._values import diverged_steps, set_hyperparameters
from meshkit.train import (
    Checkpoints,
    Dispatch,
    Evaluation,
    Logging,
    Model,
    NonFiniteLossError,
    TrainState,
    fit,
)


@functools.lru_cache(maxsize=16)
def _reassign(model: Model, layout: EnsembleLayout) -> Callable[..., TrainState]:
    """The jitted stage transition: each slot continues from ``source``, or starts afresh."""

    def reassign(state: TrainState, moves: Mapping[str, Any]) -> TrainState:
        source, refresh, active = moves["source"], moves["refresh"], moves["active"]
        seeds, values = moves["seeds"], moves["values"]
        taken = jax.tree.map(lambda leaf: jnp.take(leaf, source, axis=0), state)
        taken = taken.replace(rng=state.rng)  # a copy keeps its own dropout key
        fresh = init_members(model, state.tx, seeds, state.precision)

        def pick(new: jax.Array, kept: jax.Array) -> jax.Array:
            return jnp.where(refresh.reshape(refresh.shape + (1,) * (kept.ndim - 1)), new, kept)

        # Leaf by leaf: the fresh members' static fields (the model's apply function)
        # may be other objects of the same model.
        leaves = map(pick, jax.tree.leaves(fresh), jax.tree.leaves(taken))
        chosen = jax.tree.unflatten(jax.tree.structure(taken), list(leaves))
        return chosen.replace(opt_state=set_hyperparameters(chosen.opt_state, values, active))

    return jax.jit(reassign, out_shardings=layout.state_sharding, donate_argnums=0)


@functools.lru_cache(maxsize=16)
def _step(
    loss_fn: MemberLossFn,
    layout: EnsembleLayout,
    member_batches: bool,
    microbatches: int,
    strategy: MemberStrategy,
) -> Callable[[TrainState, Any], tuple[TrainState, Any]]:
    return ensemble_step(
        loss_fn,
        layout,
        member_batches=member_batches,
        member_metrics=True,
        donate=True,
        strategy=strategy,
        microbatches=microbatches,
        members_may_diverge=True,
    )


SWEEP_FILES = (*RUN_FILES, "sweep.json", "stage_*", "results.json")
"""What a sweep writes in its workdir (each stage is a ``fit`` run in ``stage_<i>``)."""


def sweep_pipeline(
    source: Any,
    points: Sequence[Mapping[str, Value]],
    layout: EnsembleLayout,
    *,
    global_batch_size: int,
    seed: int = 0,
    **options: Any,
) -> TrainPipeline:
    """The training pipeline a sweep of ``points`` needs.

    With ``data_seed`` among the points' names, a ``MemberTrainPipeline`` in which
    member ``k`` reads the data in the order ``TrainPipeline(seed=data_seed_k)`` would;
    otherwise one ``TrainPipeline(seed=seed)`` shared by every member. ``options``
    (``transform``, ``input_settings``...) go to the pipeline.
    """
    checked = check_points(points)
    common = {"global_batch_size": global_batch_size, "sharding": layout.batch_sharding}
    if "data_seed" in checked[0]:
        seeds = [int(p["data_seed"]) for p in checked]
        return MemberTrainPipeline(source, len(checked), member_seeds=seeds, **common, **options)
    return TrainPipeline(source, seed=seed, **common, **options)


def _checked_evaluation(sweep: object, evaluation: object) -> tuple[Evaluation, PerExampleFn]:
    """``evaluation`` with the ensemble metrics filled in, and its per-example function,
    after checking both types."""
    if not isinstance(sweep, Sweep):
        raise TypeError(
            f"run_sweep takes a meshkit.sweep.Sweep first, got {type(sweep).__name__}: build "
            "one with Sweep(model, tx, loss_fn, layout, points, ...)."
        )
    if not isinstance(evaluation, Evaluation):
        raise TypeError(
            "run_sweep(evaluation=...) must be a meshkit.train.Evaluation, got "
            f"{type(evaluation).__name__}: pass Evaluation(eval_pipeline)."
        )
    score_fn = evaluation.per_example_fn or ensemble_metrics(sweep.layout)
    return dataclasses.replace(evaluation, per_example_fn=score_fn), score_fn


def _check_pipeline(pipeline: TrainPipeline, points: Sequence[Point]) -> None:
    if "data_seed" not in points[0]:
        return
    seeds = [int(p["data_seed"]) for p in points]
    held = getattr(pipeline, "member_seeds", None)
    if not isinstance(pipeline, MemberTrainPipeline) or list(held or ()) != seeds:
        raise ValueError(
            f"The points set data_seed {seeds}, but the pipeline gives the members "
            f"{'one shared order' if held is None else f'the orders of seeds {list(held)}'}. "
            "Build it with meshkit.sweep.sweep_pipeline(source, points, layout, ...)."
        )


def _record(
    workdir: Any,
    *,
    points: Sequence[Point],
    schedule: Schedule | None,
    metric: str,
    mode: str,
    seed: int,
) -> None:
    """Writes ``sweep.json`` (what the sweep was started with), or checks a resumed one."""
    spec = {
        "points": [dict(p) for p in points],
        "schedule": None if schedule is None else repr(schedule),
        "metric": metric,
        "mode": mode,
        "seed": seed,
    }
    path = workdir / "sweep.json"
    if path.exists():
        saved = json.loads(path.read_text())
        differ = [key for key in spec if saved.get(key) != json.loads(json.dumps(spec[key]))]
        if differ:
            raise ValueError(
                f"{path} holds a sweep with other {differ}: saved "
                f"{ {key: saved.get(key) for key in differ} }, now "
                f"{ {key: spec[key] for key in differ} }. Resume with the saved settings, or "
                "start the new sweep in a new workdir."
            )
    elif jax.process_index() == 0:
        write_text_atomically(path, json.dumps(spec, indent=1) + "\n")


def run_sweep(
    sweep: Sweep,
    *,
    pipeline: TrainPipeline,
    evaluation: Evaluation,
    num_steps: int,
    workdir: PathLike,
    checkpoints: Checkpoints | None = None,
    logging: Logging | None = None,
    dispatch: Dispatch | None = None,
) -> SweepResult:
    """Trains a ``Sweep``'s K settings at once, one per member of the ensemble axis.

    The K members (``sweep.initial_state()``) train in one jitted step
    (``make_ensemble_step``), each with its own hyperparameters, data-parallel over the
    layout's data axis. With a schedule, training runs in stages: at each stage's end
    every member is evaluated on ``evaluation.pipeline`` and ``SuccessiveHalving`` or
    ``PopulationBasedTraining`` decides which members stop, restart or copy others;
    the step never recompiles. Each stage is a ``fit`` run in ``workdir/stage_<i>``
    (its checkpoints, ``metrics.jsonl`` and writers) with the settings given here, as
    ``fit`` takes them; a killed sweep rerun with the same arguments resumes and makes
    the same decisions, ending with the same table.

    Args:
      sweep: what is trained and how it is judged (``Sweep``).
      pipeline: the training data (``sweep_pipeline``).
      evaluation: the data members are scored on, and how: ``Evaluation(eval_pipeline,
        every=..., per_example_fn=...)``. ``every`` also evaluates every member that
        often within each stage (written to the stage's ``metrics.jsonl`` and writers);
        ``per_example_fn`` defaults to ``ensemble_metrics(layout)``.
      num_steps: training steps of every member.
      workdir: where stages, ``sweep.json``, ``results.json`` and ``best/`` go.
      checkpoints: each stage's ``fit`` checkpoint settings.
      logging: each stage's ``fit`` logging settings.
      dispatch: each stage's ``fit`` dispatch settings: ``Dispatch(steps_per_dispatch=
        'auto')`` runs many steps of all K members per program, with a pipeline built
        with ``InputSettings(resident=True)`` the data on the devices.
    """
    with claimed(workdir, writes=SWEEP_FILES) as path:
        return _run(
            sweep,
            pipeline=pipeline,
            evaluation=evaluation,
            num_steps=num_steps,
            workdir=path,
            checkpoints=checkpoints,
            logging=logging,
            dispatch=dispatch,
        )


def _run(
    sweep: Sweep,
    *,
    pipeline: TrainPipeline,
    evaluation: Evaluation,
    num_steps: int,
    workdir: epath.Path,
    checkpoints: Checkpoints | None,
    logging: Logging | None,
    dispatch: Dispatch | None,
) -> SweepResult:
    evaluation, score_fn = _checked_evaluation(sweep, evaluation)
    metric, schedule = sweep.metric, sweep.schedule
    checked = check_points(sweep.points)
    state = sweep.initial_state()
    _check_pipeline(pipeline, checked)
    names = tuple(name for name in checked[0] if name not in SEED_NAMES)  # checked above
    _record(
        workdir, points=checked, schedule=schedule, metric=metric, mode=sweep.mode, seed=sweep.seed
    )
    member_batches = "data_seed" in checked[0]
    step = _step(sweep.loss_fn, sweep.layout, member_batches, sweep.microbatches, sweep.strategy)
    stage_settings = {
        "evaluation": None if evaluation.every is None else evaluation,
        "checkpoints": checkpoints,
        "logging": logging,
        "dispatch": dispatch,
    }
    ends = (*(() if schedule is None else schedule.boundaries(num_steps)), num_steps)

    # Each member as initialised: where its loss ends no lower, it did not learn.
    initial = _member_losses(full_eval(score_fn, state, evaluation.pipeline).metrics, len(checked))
    roster = _Roster.start(checked, initial)
    compiles, began, start, input_path = 0, time.perf_counter(), 0, ""

    def result(state: TrainState, step: int, *, interrupted: bool = False) -> SweepResult:
        return SweepResult(
            trials=roster.trials,
            slots=roster.slots,
            state=state,
            metric=metric,
            mode=sweep.mode,
            step=step,
            workdir=workdir,
            train_step_compiles=compiles,
            interrupted=interrupted,
            wall_seconds=time.perf_counter() - began,
            input_path=input_path,  # how the stages fed and dispatched (the last stage's)
        )

    for index, end in enumerate(ends):
        stage = {**stage_settings, "workdir": workdir / f"stage_{index}", "start_step": start}
        fitted = _fit_stage(state, step, pipeline, end, settings=stage, training=roster.training())
        compiles += fitted.train_step_compiles
        input_path = f"{fitted.input_path}, {fitted.dispatch}"
        state = fitted.state
        stage_settings["dispatch"] = _calibrated(stage_settings["dispatch"], fitted)
        if fitted.preempted or fitted.stopped_early or fitted.step < end:
            return result(state, fitted.step, interrupted=True)
        roster.freeze_diverged(diverged_steps(state.opt_state), end=end, metric=metric)
        roster.record(end, full_eval(score_fn, state, evaluation.pipeline).metrics, metric)
        if end == num_steps:
            break
        state = _next_stage(sweep, roster, state, end=end, names=names)
        start = end
    roster.finish(num_steps)
    finished = result(state, num_steps)
    if jax.process_index() == 0:
        finished.write_json(workdir / "results.json")
    return finished


@dataclasses.dataclass
class _Roster:
    """A sweep's bookkeeping: every trial so far, the trial each slot trains, each slot's
    point, and which slots still train."""

    trials: list[Trial]
    slots: list[int]
    points: list[Point]
    active: np.ndarray

    @classmethod
    def start(cls, points: Sequence[Point], initial_losses: Sequence[float]) -> _Roster:
        trials = [
            Trial(k, k, dict(p), None, 0, initial_loss=initial_losses[k])
            for k, p in enumerate(points)
        ]
        return cls(trials, list(range(len(points))), list(points), np.ones(len(points), bool))

    def training(self) -> list[int]:
        """The trials training now."""
        return [self.slots[s] for s in np.flatnonzero(self.active)]

    def record(self, end: int, measured: Mapping[str, float], metric: str) -> None:
        """Each training slot's evaluation at ``end`` (``full_eval``'s metrics)."""
        scores = per_member(measured, metric)
        for slot in np.flatnonzero(self.active):
            self.trials[self.slots[slot]].record(
                end, float(scores[slot]), _member_metrics(measured, int(slot))
            )

    def scores(self) -> np.ndarray:
        """Each slot's score for a schedule; a diverged member's is NaN and ranks last
        (its last finite score is history, not its state)."""
        return np.array(
            [math.nan if self.trials[t].diverged else self.trials[t].score() for t in self.slots],
            np.float64,
        )

    def freeze_diverged(self, counts: Any, *, end: int, metric: str) -> None:
        """Marks each training member that diverged by ``end`` (``counts``: its diverged
        steps, or None where nothing counts them) as diverged and inactive, printing a
        line for each; stops the sweep when none trains."""
        if counts is None:
            return
        counts = np.asarray(to_host(counts))
        diverged = np.flatnonzero(self.active & (counts > 0))
        for slot in diverged:
            trial = self.trials[self.slots[slot]]
            trial.diverge(end - int(counts[slot]) + 1)
            self.active[slot] = False
            if jax.process_index() == 0:
                tqdm.write(describe_divergence(trial, metric))
        if diverged.size and not self.active.any():
            raise NonFiniteLossError(
                "Every trial of the sweep still training diverged: "
                + "; ".join(f"trial {t.id} at step {t.end}" for t in self.trials if t.diverged)
                + ". Lower the learning rates (or the range they are drawn from), or add "
                "gradient clipping to the optimizer."
            )

    def apply(self, decision: Decision, step: int) -> None:
        """A schedule's ``decision`` at ``step``: stopped slots, new trials in the changed
        ones (restarts, or copies continuing their donor's scores)."""
        slots = list(self.slots)
        for slot in np.flatnonzero(self.active & ~decision.active):
            self.trials[self.slots[slot]].stop(step)
        for slot in decision.changed:
            old = self.trials[self.slots[slot]]
            if not old.diverged:  # a diverged trial keeps its status and step
                old.replace(step)
            parent = None if decision.refresh[slot] else self.slots[int(decision.source[slot])]
            trial = Trial(len(self.trials), slot, dict(decision.points[slot]), parent, step)
            # A copy continues its donor's scores; a fresh start is judged by the slot's first.
            origin = self.trials[self.slots[slot] if parent is None else parent]
            trial.initial_loss = origin.initial_loss
            if parent is not None:
                trial.history = list(origin.history)
                trial.metrics = dict(origin.metrics)
            self.trials.append(trial)
            slots[slot] = trial.id
        self.slots, self.points = slots, list(decision.points)
        # A diverged trial stays frozen in its slot until a schedule gives the slot another.
        self.active = decision.active & np.array(
            [self.trials[t].status == "training" for t in slots]
        )

    def finish(self, num_steps: int) -> None:
        for slot in np.flatnonzero(self.active):
            self.trials[self.slots[slot]].finish(num_steps)


def _next_stage(
    sweep: Sweep, roster: _Roster, state: TrainState, *, end: int, names: tuple[str, ...]
) -> TrainState:
    """The schedule's decision at ``end``, applied to the roster and the state (in one
    jitted program), each change printed as a line."""
    decision = decide(
        sweep.schedule,
        step=end,
        scores=roster.scores(),
        active=roster.active,
        points=roster.points,
        mode=sweep.mode,
        space=sweep.space,
        seed=sweep.seed,
    )
    moves = {
        "source": np.asarray(decision.source, np.int32),
        "refresh": decision.refresh,
        "active": decision.active,
        "seeds": init_keys(decision.points, sweep.seed),
        "values": value_arrays(decision.points, names),
    }
    state = _reassign(sweep.model, sweep.layout)(state, moves)
    before = roster.slots
    roster.apply(decision, end)
    if jax.process_index() == 0:
        for line in describe_decision(
            decision, roster.trials, before, roster.slots, step=end, metric=sweep.metric
        ):
            tqdm.write(line)
    return state


def describe_decision(
    decision: Decision,
    trials: list[Trial],
    before: list[int],
    after: list[int],
    *,
    step: int,
    metric: str,
) -> list[str]:
    """One line per slot a schedule changed at ``step``: stopped, restarted, or copying
    a better trial with perturbed values (population-based training).

    Examples:
        >>> t = [Trial(0, 0, {"lr": 0.1}, None, 0), Trial(1, 1, {"lr": 0.01}, None, 0),
        ...      Trial(2, 0, {"lr": 0.012}, 1, 50)]
        >>> t[0].record(50, 0.4, {}); t[1].record(50, 0.9, {})
        >>> d = Decision(np.array([1, 1]), np.array([False, False]), np.array([True, True]),
        ...              ({"lr": 0.012}, {"lr": 0.01}), (0,))
        >>> for part in describe_decision(d, t, [0, 1], [2, 1], step=50, metric="accuracy")[
        ...     0
        ... ].split(": "):
        ...     print(part)
        step 50
        slot 0 (trial 0, accuracy 0.4000) copies trial 1 (0.9000) as trial 2
        lr 0.01 -> 0.012
    """
    lines = []
    for slot in decision.changed:
        old, new = trials[before[slot]], trials[after[slot]]
        state = f"diverged at {old.end}" if old.diverged else f"{metric} {old.score():.4f}"
        where = f"step {step}: slot {slot} (trial {old.id}, {state})"
        if new.parent is None:
            values = _changes(old.point, new.point) or "the same values"
            lines.append(f"{where} restarts as trial {new.id}: {values}")
        else:  # a copy: its values against its donor's (perturbed, or kept)
            donor = trials[new.parent]
            kept = {k: v for k, v in new.point.items() if k not in SEED_NAMES}  # the slot's
            values = _changes(donor.point, kept) or "its values as they are"
            lines.append(
                f"{where} copies trial {donor.id} ({donor.score():.4f}) as trial {new.id}: {values}"
            )
    for slot in np.flatnonzero(~decision.active):
        trial = trials[after[slot]]
        if slot not in decision.changed and trial.status == "stopped" and trial.end == step:
            lines.append(f"step {step}: slot {slot} (trial {trial.id}, {metric} "
                         f"{trial.score():.4f}) stops")  # fmt: skip
    return lines


def _calibrated(dispatch: Dispatch | None, result: Any) -> Dispatch | None:
    """The next stage's dispatch: ``'auto'``'s choice once a stage calibrated it."""
    if dispatch is None or result.calibration is None:
        return dispatch
    return dataclasses.replace(dispatch, steps_per_dispatch=result.steps_per_dispatch)


def _fit_stage(
    state: TrainState,
    step: Callable[..., Any],
    pipeline: TrainPipeline,
    end: int,
    *,
    settings: Mapping[str, Any],
    training: list[int],
) -> Any:
    """One stage's ``fit`` to step ``end``; ``training``: the trials training in it."""
    try:
        return fit(state, step, pipeline, num_steps=end, **settings)
    except NonFiniteLossError as error:  # no member's loss was finite any more
        stage = as_path(settings["workdir"]).name
        raise NonFiniteLossError(
            f"Every member of the sweep diverged (trials {training}, in {stage}). {error}"
        ) from None


def describe_divergence(trial: Trial, metric: str) -> str:
    """The line a sweep prints when a member's trial diverged (and is frozen)."""
    last = "no evaluation yet" if not trial.history else f"{metric} {trial.score():.4f}"
    return (
        f"step {trial.end}: slot {trial.slot} (trial {trial.id}) diverged: its loss or "
        f"gradients were not finite; it is frozen, the others train on (last: {last})"
    )


def _changes(before: Mapping[str, Value], after: Mapping[str, Value]) -> str:
    """``"learning_rate 0.001 -> 0.0012"`` for each value that differs."""
    return ", ".join(
        f"{name} {before.get(name, float('nan')):.4g} -> {after[name]:.4g}"
        for name in after
        if after[name] != before.get(name)
    )


def _member_losses(measured: Mapping[str, float], members: int) -> list[float]:
    """Each member's evaluation loss (NaN where the evaluation reports none)."""
    return [float(measured.get(f"member_{k}/loss", math.nan)) for k in range(members)]


def _member_metrics(measured: Mapping[str, float], slot: int) -> dict[str, float]:
    prefix = f"member_{slot}/"
    return {k[len(prefix) :]: float(v) for k, v in measured.items() if k.startswith(prefix)}
