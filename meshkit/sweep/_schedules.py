"""Successive halving and population-based training: decisions made on the host, between stages.

A decision reads each member's score (its evaluation at the stage's end) and says, per
slot, which member's state it continues from (``source``), whether it starts afresh
(``refresh``), whether it trains on (``active``) and its next point. K stays fixed, so
the train step never recompiles. Decisions are drawn from ``(seed, step)`` only: a
resumed sweep makes the same ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from meshkit.sweep._space import SEED_NAMES, LogUniform, Point, Space, Uniform

Mode = Literal["max", "min"]


@dataclasses.dataclass(frozen=True)
class SuccessiveHalving:
    """At each rung, the worst ``fraction`` of the members still training stop.

    Attributes:
      rungs: the steps at which members are ranked (each below ``num_steps``).
      fraction: the share of the training members that stop at each rung (rounded
        down, at least one while two or more train).
      refill: ``False``: a stopped member is frozen (it keeps its parameters and its
        score). ``True``: its slot restarts from scratch with a new point drawn from
        the sweep's ``space``, so every device stays busy.
    """

    rungs: tuple[int, ...]
    fraction: float = 0.5
    refill: bool = False

    def __post_init__(self) -> None:
        if not self.rungs or list(self.rungs) != sorted(set(self.rungs)) or self.rungs[0] < 1:
            raise ValueError(
                f"rungs must be increasing positive steps, got {self.rungs!r}, e.g. (100, 200)."
            )
        if not 0 < self.fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {self.fraction!r}, e.g. 0.5.")

    def boundaries(self, num_steps: int) -> tuple[int, ...]:
        return tuple(r for r in self.rungs if r < num_steps)


@dataclasses.dataclass(frozen=True)
class PopulationBasedTraining:
    """Every ``every`` steps, the bottom ``quantile`` copies the top and perturbs its values.

    Each member in the bottom quantile (by score) takes the state of a member drawn from
    the top quantile (parameters, optimizer state, loss scale and step; it keeps its own
    dropout key) and that member's hyperparameters, each then perturbed: a value from a
    range is multiplied by one of ``factors`` (kept inside the range), a value from a
    list moves to a neighbouring one, and with probability ``resample_probability`` a
    value is drawn afresh from the space. Seeds are not perturbed.
    """

    every: int
    quantile: float = 0.25
    factors: tuple[float, float] = (0.8, 1.25)
    resample_probability: float = 0.25

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1 step, got {self.every!r}.")
        if not 0 < self.quantile <= 0.5:
            raise ValueError(f"quantile must be in (0, 0.5], got {self.quantile!r}, e.g. 0.25.")
        if not 0 <= self.resample_probability <= 1:
            raise ValueError(
                f"resample_probability must be in [0, 1], got {self.resample_probability!r}."
            )

    def boundaries(self, num_steps: int) -> tuple[int, ...]:
        return tuple(range(self.every, num_steps, self.every))


Schedule = SuccessiveHalving | PopulationBasedTraining


@dataclasses.dataclass(frozen=True)
class Decision:
    """What happens to each of the K slots at a stage boundary."""

    source: np.ndarray  # [K] int: the slot whose state this slot continues from
    refresh: np.ndarray  # [K] bool: start afresh (new parameters, optimizer state, step)
    active: np.ndarray  # [K] bool: train on
    points: tuple[Point, ...]  # every slot's point from here on
    changed: tuple[int, ...]  # slots given a new trial


def ranking(scores: np.ndarray, mode: Mode) -> np.ndarray:
    """Slots best first (ties: the lower slot first); NaN scores rank last."""
    keyed = np.where(np.isnan(scores), -np.inf, scores if mode == "max" else -scores)
    return np.lexsort((np.arange(len(scores)), -keyed))


def _rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def halving_decision(
    schedule: SuccessiveHalving,
    *,
    step: int,
    scores: np.ndarray,
    active: np.ndarray,
    points: Sequence[Point],
    mode: Mode,
    space: Space | None,
    seed: int,
) -> Decision:
    num = len(points)
    training = [int(i) for i in ranking(scores, mode) if active[i]]
    stop = math.floor(len(training) * schedule.fraction) if len(training) > 1 else 0
    if len(training) > 1:
        stop = max(stop, 1)
    stopped = sorted(training[len(training) - stop :])
    new_points = list(points)
    new_active = active.copy()
    refresh = np.zeros(num, bool)
    if schedule.refill:
        assert space is not None
        rng = _rng(seed, step)
        for slot in stopped:
            drawn = space.draw(rng)
            if "data_seed" in points[slot]:  # a slot's data order is its pipeline column
                drawn["data_seed"] = points[slot]["data_seed"]
            new_points[slot] = {name: drawn[name] for name in points[slot]}
            refresh[slot] = True
    else:
        new_active[stopped] = False
    return Decision(
        np.arange(num),
        refresh,
        new_active,
        tuple(new_points),
        tuple(stopped) if schedule.refill else (),
    )


def _perturb(
    point: Point, space: Space | None, schedule: PopulationBasedTraining, rng: np.random.Generator
) -> Point:
    new = dict(point)
    for name, value in point.items():
        if name in SEED_NAMES:
            continue
        dimension = None if space is None else space.dimensions.get(name)
        if dimension is not None and rng.uniform() < schedule.resample_probability:
            new[name] = space.draw(rng)[name]  # pyright: ignore[reportOptionalMemberAccess]
        elif isinstance(dimension, tuple):
            values = list(dimension)
            here = values.index(value) if value in values else 0
            new[name] = values[int(np.clip(here + rng.choice([-1, 1]), 0, len(values) - 1))]
        else:
            factor = float(rng.choice(schedule.factors))
            perturbed = float(value) * factor
            if isinstance(dimension, (Uniform, LogUniform)):
                perturbed = float(np.clip(perturbed, dimension.low, dimension.high))
            new[name] = perturbed
    return new


def pbt_decision(
    schedule: PopulationBasedTraining,
    *,
    step: int,
    scores: np.ndarray,
    points: Sequence[Point],
    mode: Mode,
    space: Space | None,
    seed: int,
) -> Decision:
    num = len(points)
    order = [int(i) for i in ranking(scores, mode)]
    count = max(1, math.floor(num * schedule.quantile)) if num > 1 else 0
    top, bottom = order[:count], order[num - count :]
    rng = _rng(seed, step)
    source = np.arange(num)
    new_points = list(points)
    for slot in sorted(bottom):
        donor = int(rng.choice(top))
        source[slot] = donor
        perturbed = _perturb(points[donor], space, schedule, rng)
        for name in SEED_NAMES:  # a slot keeps its own seeds
            if name in points[slot]:
                perturbed[name] = points[slot][name]
        new_points[slot] = perturbed
    return Decision(
        source, np.zeros(num, bool), np.ones(num, bool), tuple(new_points), tuple(sorted(bottom))
    )


def decide(
    schedule: Schedule | None,
    *,
    step: int,
    scores: np.ndarray,
    active: np.ndarray,
    points: Sequence[Point],
    mode: Mode,
    space: Space | None,
    seed: int,
) -> Decision:
    """The decision ``schedule`` makes at ``step`` (halving reads ``active``; PBT does not)."""
    if isinstance(schedule, SuccessiveHalving):
        return halving_decision(
            schedule,
            step=step,
            scores=scores,
            active=active,
            points=points,
            mode=mode,
            space=space,
            seed=seed,
        )
    assert isinstance(schedule, PopulationBasedTraining)
    return pbt_decision(
        schedule, step=step, scores=scores, points=points, mode=mode, space=space, seed=seed
    )
