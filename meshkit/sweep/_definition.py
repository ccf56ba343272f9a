"""``Sweep``: what a sweep trains and how it judges, apart from how a run feeds and saves it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import optax

from meshkit._checks import check_int
from meshkit.ensemble import EnsembleLayout, MemberLossFn
from meshkit.ensemble._strategy import MemberStrategy
from meshkit.sweep._schedules import Mode, Schedule, SuccessiveHalving
from meshkit.sweep._space import Space, Value, check_points
from meshkit.sweep._state import check_layout_holds, create_sweep_state
from meshkit.train import Model, Precision, TrainState


@dataclasses.dataclass(frozen=True)
class Sweep:
    """K settings of one model trained side by side, and how they are judged.

    ``run_sweep(sweep, ...)`` trains it with ``fit``'s own settings (``pipeline``,
    ``evaluation``, ``checkpoints``, ``logging``, ``dispatch``), so one ``Sweep`` can be
    run on other data, for longer, or into another workdir unchanged.

    Attributes:
      model: the model (``linen_model`` or ``nnx_model``).
      tx: the optimizer; sweep optimizer hyperparameters by wrapping it in
        ``optax.inject_hyperparams``.
      loss_fn: one member's loss (``meshkit.ensemble.classification_loss``, or one that
        reads ``hyperparameter(state, name)``).
      layout: the ``EnsembleLayout``, holding ``len(points)`` members.
      points: the K settings (``Space(...).grid()``, ``.sample(K)``, or dicts).
      metric: the score, a per-member metric of the evaluation.
      mode: whether higher (``"max"``) or lower (``"min"``) scores are better.
      schedule: ``None`` (every member trains to the end), ``SuccessiveHalving`` or
        ``PopulationBasedTraining``.
      space: where refilled and resampled points come from (``SuccessiveHalving(refill=
        True)`` needs it).
      loss_values: the points' names the loss reads (not optimizer hyperparameters).
      seed: the init seed of points without ``init_seed``, and the schedule's seed.
      precision: the members' precision policy (``"bf16"``, ``"f16"``...), as for
        ``create_ensemble_state``.
      microbatches: gradient accumulation steps per member, as for
        ``make_ensemble_step``.
      strategy: how each device runs its members (``"auto"``, ``"vmap"``, ``"loop"``),
        as for ``make_ensemble_step``.

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, sweep, train
        >>> points = sweep.Space(learning_rate=[0.1, 0.01]).grid()
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 2)
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> two = sweep.Sweep(model, tx, ensemble.classification_loss, layout, points)
        >>> two.num_members, two.metric, two.mode
        (2, 'accuracy', 'max')
        >>> sweep.Sweep(model, tx, ensemble.classification_loss, layout, points,
        ...             mode="best")
        Traceback (most recent call last):
        ...
        ValueError: Sweep(mode=...) must be 'max' (higher scores are better) or 'min', got 'best'.
    """

    model: Model
    tx: optax.GradientTransformation
    loss_fn: MemberLossFn
    layout: EnsembleLayout
    points: Sequence[Mapping[str, Value]]
    metric: str = "accuracy"
    mode: Mode = "max"
    schedule: Schedule | None = None
    space: Space | None = None
    loss_values: Sequence[str] = ()
    seed: int = 0
    precision: Precision | str | None = None
    microbatches: int = 1
    strategy: MemberStrategy = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(check_points(self.points)))
        object.__setattr__(self, "loss_values", tuple(self.loss_values))
        if not isinstance(self.layout, EnsembleLayout):
            raise TypeError(
                f"Sweep(layout=...) must be a meshkit.ensemble.EnsembleLayout, got "
                f"{self.layout!r}. Build one with EnsembleLayout(mesh, len(points))."
            )
        check_layout_holds(self.points, self.layout)
        if self.mode not in ("max", "min"):
            raise ValueError(
                f"Sweep(mode=...) must be 'max' (higher scores are better) or 'min', got "
                f"{self.mode!r}."
            )
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"Sweep(metric=...) must be a metric's name, got {self.metric!r}.")
        refills = isinstance(self.schedule, SuccessiveHalving) and self.schedule.refill
        if refills and self.space is None:
            raise ValueError(
                "SuccessiveHalving(refill=True) fills stopped slots with points drawn from a "
                "space: pass Sweep(space=...) (the Space the points came from), or "
                "refill=False."
            )
        check_int(self.seed, name="Sweep(seed=...)", minimum=0)
        check_int(self.microbatches, name="Sweep(microbatches=...)", minimum=1)

    @property
    def num_members(self) -> int:
        """K, the points trained side by side."""
        return len(self.points)

    def initial_state(self) -> TrainState:
        """The K members before training (``create_sweep_state``)."""
        return create_sweep_state(
            self.model,
            self.tx,
            self.layout,
            self.points,
            loss_values=self.loss_values,
            seed=self.seed,
            precision=self.precision,
        )
