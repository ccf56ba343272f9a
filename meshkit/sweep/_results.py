"""What a sweep found: its trials, ranked, the winner's state, a table and a plot."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from meshkit._paths import PathLike, as_path, write_text_atomically
from meshkit.ensemble import member_state
from meshkit.sweep._schedules import Mode
from meshkit.sweep._space import Point
from meshkit.train import TrainState

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def rank_key(status: str, score: float | None, mode: str) -> tuple[bool, float]:
    """Where a trial ranks: finished ones first, then by score (best first; NaN last)."""
    value = math.nan if score is None else float(score)
    sign = -1.0 if mode == "max" else 1.0
    return status != "finished", math.inf if math.isnan(value) else sign * value


def format_table(
    header: Sequence[str], body: Sequence[Sequence[str]], *, left: Sequence[int]
) -> str:
    """Columns as wide as their widest cell, two spaces apart; columns ``left`` are
    left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [header, *body]
    )


LEARNED = 0.99
"""A trial finishes as ``"did not learn"`` where its evaluation loss at the end is not
below this share of its loss as initialised."""


@dataclasses.dataclass
class Trial:
    """One point trained in one slot, from ``start`` to ``end``.

    Attributes:
      id: the trial's number (the first K are the sweep's points, in order).
      slot: the member slot it trained in.
      point: its hyperparameters.
      parent: the trial it copied its state from (population-based training), or ``None``.
      start: the step it began at.
      end: the step it ended at, or ``None`` while it trains.
      status: ``"training"``, ``"finished"``, ``"did not learn"`` (it ended with an
        evaluation loss no lower than ``LEARNED`` of its loss as initialised: at
        chance, or gone flat after a rate too high), ``"stopped"`` (halving froze it),
        ``"diverged"`` (its loss or gradients stopped being finite at step ``end``; it
        was frozen and keeps the scores it had) or ``"replaced"`` (its slot went to
        another trial).
      history: its score at each evaluation, ``(step, score)`` (a copy inherits its
        parent's).
      metrics: its member metrics at its last evaluation.
      initial_loss: its evaluation loss as initialised (a copy: its donor's), or NaN.
    """

    id: int
    slot: int
    point: Point
    parent: int | None
    start: int
    end: int | None = None
    status: str = "training"
    history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    initial_loss: float = math.nan

    def record(self, step: int, score: float, metrics: dict[str, float]) -> None:
        self.history.append((step, score))
        self.metrics = metrics

    def score(self) -> float:
        return self.history[-1][1] if self.history else math.nan

    def finish(self, step: int) -> None:
        """Ends it at ``step``: finished, or did not learn (see ``LEARNED``)."""
        loss = self.metrics.get("loss", math.nan)
        stuck = loss >= LEARNED * self.initial_loss  # False where either is NaN
        self.end, self.status = step, "did not learn" if stuck else "finished"

    def stop(self, step: int) -> None:
        self.end, self.status = step, "stopped"

    def replace(self, step: int) -> None:
        self.end, self.status = step, "replaced"

    def diverge(self, step: int) -> None:
        self.end, self.status = step, "diverged"

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def status_text(self) -> str:
        """Its status, with the step for a diverged trial (``"diverged at 16"``)."""
        return f"diverged at {self.end}" if self.diverged else self.status


@dataclasses.dataclass
class SweepResult:
    """A finished (or interrupted) sweep.

    Attributes:
      trials: every trial, in the order they began.
      slots: the trial each member slot holds at the end.
      state: the ensemble state at the end (every slot's member).
      metric, mode: the score and its direction.
      step: the step the sweep reached.
      workdir: where its stages and files are.
      train_step_compiles: compilations of the train step over all stages.
      interrupted: a preemption or hook stopped it before ``num_steps``.
      wall_seconds: the time ``run_sweep`` took.
      input_path: how the last stage fed and dispatched its steps (``fit``'s
        ``input_path`` and ``dispatch``).
    """

    trials: list[Trial]
    slots: list[int]
    state: TrainState
    metric: str
    mode: Mode
    step: int
    workdir: Any
    train_step_compiles: int
    interrupted: bool = False
    wall_seconds: float = 0.0
    input_path: str = ""

    def ranked(self) -> list[Trial]:
        """Trials best first: finished ones by score, then the others by score."""
        return sorted(self.trials, key=lambda t: (*rank_key(t.status, t.score(), self.mode), t.id))

    @property
    def best(self) -> Trial:
        """The finished trial with the best score."""
        ranked = self.ranked()
        if ranked and ranked[0].status == "did not learn":
            raise ValueError(
                f"No trial of the sweep learned: each ended with an evaluation loss no "
                f"lower than {LEARNED:.0%} of its loss as initialised. Try smaller learning "
                "rates (or more steps)."
            )
        if not ranked or ranked[0].status != "finished":
            raise ValueError(
                "The sweep has no finished trial (it was interrupted): rerun run_sweep with "
                "the same workdir to resume it."
            )
        return ranked[0]

    def best_state(self) -> TrainState:
        """The winner as an ordinary ``TrainState`` (no member axis), replicated on the mesh.

        It works with ``meshkit.train.make_train_step`` and ``fit``, ``full_eval`` and
        ``meshkit.to_host``; every process must call it.
        """
        return member_state(self.state, self.best.slot)

    def save_best(self, directory: PathLike | None = None) -> Any:
        """Saves the winner as a ``meshkit.train`` checkpoint with its hyperparameters.

        Writes a checkpoint of ``best_state()`` at the sweep's step (restore it with
        ``Checkpointer(directory, save_every=1).restore(target)``) and
        ``hyperparameters.json``; ``directory`` defaults to ``workdir/best``. Returns it.
        """
        from meshkit.checkpoint import Checkpointer

        target = as_path(directory if directory is not None else self.workdir / "best")
        state = self.best_state()
        checkpointer = Checkpointer(target, save_every=1, keep=1)
        try:
            checkpointer.save(self.step, state, {"step": self.step}, force=True)
            checkpointer.wait()
        finally:
            checkpointer.close()
        if jax.process_index() == 0:
            record = {"trial": self.best.id, "metric": self.metric, "score": self.best.score()}
            record["hyperparameters"] = self.best.point
            write_text_atomically(
                target / "hyperparameters.json", json.dumps(record, indent=1) + "\n"
            )
        return target

    def to_json(self) -> dict[str, Any]:
        """The sweep as plain JSON values: trials best first, with their scores and lineage."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "step": self.step,
            "train_step_compiles": self.train_step_compiles,
            "interrupted": self.interrupted,
            "trials": [
                {
                    "trial": t.id,
                    "slot": t.slot,
                    "status": t.status,
                    "score": t.score(),
                    "hyperparameters": t.point,
                    "parent": t.parent,
                    "start": t.start,
                    "end": t.end,
                    "metrics": t.metrics,
                    "initial_loss": t.initial_loss,
                    "history": [list(h) for h in t.history],
                }
                for t in self.ranked()
            ],
        }

    def write_json(self, path: PathLike) -> None:
        """Writes ``to_json()`` to ``path``."""
        write_text_atomically(as_path(path), json.dumps(self.to_json(), indent=1) + "\n")

    def table(self, limit: int | None = None) -> str:
        """A text table of the trials, best first (with a ``parent`` column when a trial
        copied another's state: population-based training).

        Examples:
            >>> trials = [Trial(0, 0, {"learning_rate": 0.1}, None, 0),
            ...           Trial(1, 1, {"learning_rate": 0.01}, None, 0)]
            >>> for trial, score in zip(trials, [0.5, 0.9]):
            ...     trial.record(10, score, {})
            ...     trial.finish(10)
            >>> result = SweepResult(trials=trials, slots=[0, 1], state=None, metric="accuracy",
            ...                      mode="max", step=10, workdir=".", train_step_compiles=1)
            >>> print(result.table())
            rank  trial  slot  status    accuracy  learning_rate
               1      1     1  finished    0.9000           0.01
               2      0     0  finished    0.5000            0.1
        """
        rows = self.ranked()[:limit]
        names = list(rows[0].point) if rows else []
        lineage = any(t.parent is not None for t in self.trials)  # population-based training
        header = ["rank", "trial", *(["parent"] if lineage else []), "slot", "status"]
        header += [self.metric, *names]
        body = [
            [
                str(rank),
                str(t.id),
                *([("-" if t.parent is None else str(t.parent))] if lineage else []),
                str(t.slot),
                t.status_text(),
                f"{t.score():.4f}",
                *(f"{t.point[n]:.4g}" for n in names),
            ]
            for rank, t in enumerate(rows, 1)
        ]
        return format_table(header, body, left=(4 if lineage else 3,))

    def curves(self) -> dict[int, list[tuple[int, float]]]:
        """Each slot's training loss over the steps, read from the stages' ``metrics.jsonl``."""
        curves: dict[int, list[tuple[int, float]]] = {slot: [] for slot in range(len(self.slots))}
        for stage in sorted(as_path(self.workdir).glob("stage_*"), key=_stage_number):
            path = stage / "metrics.jsonl"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                record = json.loads(line)
                for slot, curve in curves.items():
                    value = record.get(f"member_{slot}/loss")
                    if value is not None:
                        curve.append((int(record["step"]), float(value)))
        return curves

    def plot(self, path: PathLike) -> Figure:
        """A PNG: each slot's training loss, and each trial's score at the evaluations
        (the trials ranked, as bars, where each was evaluated once); returns the
        matplotlib ``Figure``.

        The winner is drawn thick and coloured, the others thin and grey; a trial that
        copied another (population-based training) starts from its parent's point.
        """
        from matplotlib.figure import Figure  # not pyplot: the caller's backend stays

        best = self.best
        figure = Figure(figsize=(11, 4.2))
        loss_axes, score_axes = figure.subplots(1, 2)
        for slot, points in self.curves().items():
            if points:
                steps, values = zip(*points, strict=True)
                winner = slot == best.slot
                loss_axes.plot(
                    steps,
                    values,
                    color="tab:red" if winner else "0.6",
                    linewidth=2.2 if winner else 0.8,
                    zorder=3 if winner else 1,
                    label=f"slot {slot} (winner)" if winner else None,
                )
        loss_axes.set(xlabel="step", ylabel="training loss", title="Members' training loss")
        loss_axes.set_yscale("log")
        if any(len(trial.history) > 1 for trial in self.trials):
            self._plot_score_curves(score_axes, best)
        else:  # one evaluation each (a sweep without a schedule): the trials ranked
            self._plot_score_ranks(score_axes, best)
        hyper = ", ".join(f"{k}={v:.3g}" for k, v in best.point.items())
        score_axes.set_title(f"Evaluation {self.metric}\nwinner: {hyper}", fontsize=9)
        if loss_axes.get_legend_handles_labels()[0]:
            loss_axes.legend(loc="upper right")
        figure.tight_layout()
        target = as_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as file:
            figure.savefig(file, format="png", dpi=110)
        return figure

    def _plot_score_curves(self, axes: Any, best: Trial) -> None:
        """Each trial's score at each evaluation step, the winner (``best``) in red."""
        for trial in self.trials:
            if trial.history:
                steps, values = zip(*trial.history, strict=True)
                winner = trial.id == best.id
                axes.plot(
                    steps,
                    values,
                    marker="o",
                    markersize=3,
                    color="tab:red" if winner else "0.6",
                    linewidth=2.2 if winner else 0.8,
                    zorder=3 if winner else 1,
                )
        axes.set(xlabel="step", ylabel=self.metric)

    def _plot_score_ranks(self, axes: Any, best: Trial) -> None:
        """One bar per trial, its last score, in the table's order: the winner on top, in red."""
        scored = [trial for trial in self.ranked() if trial.history]
        scores = [trial.history[-1][1] for trial in scored]
        labels = [", ".join(f"{v:.3g}" for v in trial.point.values()) for trial in scored]
        colors = ["tab:red" if trial.id == best.id else "0.6" for trial in scored]
        rows = range(len(scored))
        axes.barh(rows, scores, color=colors)
        axes.set_yticks(rows, labels, fontsize=max(5, min(9, 160 // max(len(scored), 1))))
        axes.invert_yaxis()  # the best on top
        names = ", ".join(self.trials[0].point) if self.trials else ""
        steps = {trial.history[-1][0] for trial in scored}
        when = f"at step {steps.pop()}" if len(steps) == 1 else "at each trial's evaluation"
        axes.set(xlabel=f"{self.metric} {when}", ylabel=names)

    def hyperparameters(self, slots: Sequence[int] | None = None) -> list[Point]:
        """The point each slot holds at the end."""
        chosen = range(len(self.slots)) if slots is None else slots
        return [self.trials[self.slots[s]].point for s in chosen]


def _stage_number(path: Any) -> int:
    return int(str(path.name).split("_")[1])
