"""Search spaces: grids, random draws and explicit lists of hyperparameter points."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

Value = float | int
Point = dict[str, Value]
"""One setting: hyperparameter name -> value (``init_seed`` and ``data_seed`` are ints)."""

SEED_NAMES = ("init_seed", "data_seed")
"""Names that pick a member's random streams instead of a hyperparameter."""


def _finite(value: object, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"Hyperparameter {name!r} got {value!r} ({type(value).__name__}): expected a real "
            "scalar (an int or a float). Pass one number per point."
        )
    if not math.isfinite(float(value)):
        raise ValueError(
            f"Hyperparameter {name!r} got {value!r}: expected a finite number. Remove it "
            "from the space."
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Values drawn uniformly from ``[low, high]``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        low, high = _finite(self.low, name="low"), _finite(self.high, name="high")
        if not low < high:
            raise ValueError(f"Uniform needs low < high, got low={low!r}, high={high!r}.")

    def draw(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """Values whose logarithm is uniform on ``[log low, log high]`` (learning rates, decays)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        low, high = _finite(self.low, name="low"), _finite(self.high, name="high")
        if not 0 < low < high:
            raise ValueError(
                f"LogUniform needs 0 < low < high, got low={low!r}, high={high!r}. Use "
                "Uniform for a range that includes 0."
            )

    def draw(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


Dimension = Sequence[Value] | Uniform | LogUniform
"""A list of values (grid points, or a choice when sampling), or a range to draw from."""


def log_grid(low: float, high: float, num: int) -> tuple[float, ...]:
    """``num`` values evenly spaced in log scale from ``low`` to ``high``, both included.

    Examples:
        >>> log_grid(1e-3, 1e-1, 3)
        (0.001, 0.01, 0.1)
    """
    LogUniform(low, high)  # the same checks
    if num < 2:
        raise ValueError(f"log_grid needs num >= 2 values, got {num}.")
    return tuple(float(f"{v:.6g}") for v in np.geomspace(low, high, num))


def _values(name: str, dimension: Sequence[Value]) -> tuple[Value, ...]:
    values = tuple(dimension)
    if not values:
        raise ValueError(
            f"Hyperparameter {name!r} has no values: give at least one (a list, or a "
            "Uniform / LogUniform range)."
        )
    checked = []
    for value in values:
        number = _finite(value, name=name)
        if name in SEED_NAMES:
            if number != int(number) or number < 0:
                raise ValueError(f"{name!r} values must be non-negative ints, got {value!r}.")
            checked.append(int(number))
        else:
            checked.append(number)
    return tuple(checked)


class Space:
    """Named hyperparameter dimensions, from which a sweep's K points are made.

    Each keyword names a hyperparameter: an optimizer hyperparameter (from
    ``optax.inject_hyperparams``: ``learning_rate``, ``weight_decay``, ``b1``...), a
    scalar the loss reads (``hyperparameter(state, name)``), or ``init_seed`` /
    ``data_seed``. A list gives the values a grid crosses (or a random draw picks
    from); ``Uniform`` and ``LogUniform`` give ranges to draw from.

    Examples:
        >>> space = Space(learning_rate=log_grid(1e-3, 1e-1, 3), weight_decay=[0.0, 1e-4])
        >>> points = space.grid()
        >>> len(points), points[0]
        (6, {'learning_rate': 0.001, 'weight_decay': 0.0})
        >>> drawn = Space(learning_rate=LogUniform(1e-4, 1e-1)).sample(4, seed=0)
        >>> len(drawn), all(1e-4 <= p["learning_rate"] <= 1e-1 for p in drawn)
        (4, True)
    """

    def __init__(self, **dimensions: Dimension):
        if not dimensions:
            raise ValueError(
                "The space is empty: name at least one hyperparameter, e.g. "
                "Space(learning_rate=LogUniform(1e-4, 1e-1))."
            )
        self.dimensions: dict[str, Uniform | LogUniform | tuple[Value, ...]] = {}
        for name, dimension in dimensions.items():
            if isinstance(dimension, (Uniform, LogUniform)):
                if name in SEED_NAMES:
                    raise TypeError(f"{name!r} takes a list of ints, not {dimension!r}.")
                self.dimensions[name] = dimension
            elif isinstance(dimension, (str, bytes)) or not isinstance(dimension, Sequence):
                raise TypeError(
                    f"Hyperparameter {name!r} got {dimension!r}: expected a list of values, "
                    "Uniform(low, high) or LogUniform(low, high)."
                )
            else:
                self.dimensions[name] = _values(name, dimension)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.dimensions)

    def grid(self) -> tuple[Point, ...]:
        """Every combination of the listed values (the last name varies fastest)."""
        ranges = [n for n, d in self.dimensions.items() if isinstance(d, (Uniform, LogUniform))]
        if ranges:
            raise ValueError(
                f"A grid needs a list of values for every hyperparameter; {ranges} are "
                "ranges. Use sample(num_points) for ranges, or give their values with "
                "log_grid(low, high, num)."
            )
        lists = [tuple(self.dimensions[name]) for name in self.names]  # pyright: ignore[reportArgumentType]
        combinations = itertools.product(*lists)
        return tuple(dict(zip(self.names, values, strict=True)) for values in combinations)

    def draw(self, rng: np.random.Generator) -> Point:
        """One random point: each range drawn, each list's value picked uniformly."""
        point: Point = {}
        for name, dimension in self.dimensions.items():
            if isinstance(dimension, (Uniform, LogUniform)):
                point[name] = dimension.draw(rng)
            else:
                point[name] = dimension[int(rng.integers(len(dimension)))]
        return point

    def sample(self, num_points: int, *, seed: int = 0) -> tuple[Point, ...]:
        """``num_points`` random points, the same for the same ``seed``."""
        if num_points < 1:
            raise ValueError(f"sample needs num_points >= 1, got {num_points}.")
        rng = np.random.default_rng(seed)
        return tuple(self.draw(rng) for _ in range(num_points))

    def __repr__(self) -> str:
        return f"Space({', '.join(f'{n}={d!r}' for n, d in self.dimensions.items())})"


def check_points(points: Sequence[Mapping[str, Value]]) -> tuple[Point, ...]:
    """The points as plain dicts, checked: non-empty, same names, finite scalars.

    Examples:
        >>> check_points([{"learning_rate": 0.1}, {"learning_rate": 0.01}])[1]
        {'learning_rate': 0.01}
    """
    points = tuple(points)
    if not points:
        raise ValueError(
            "The sweep has no points: pass Space(...).grid(), Space(...).sample(K) or a "
            "list of dicts such as [{'learning_rate': 0.1}, {'learning_rate': 0.01}]."
        )
    names = tuple(points[0])
    if not names:
        raise ValueError("The sweep's points name no hyperparameter: {} is empty.")
    checked: list[Point] = []
    for index, point in enumerate(points):
        if tuple(point) != names:
            raise ValueError(
                f"Every point must name the same hyperparameters in the same order: point 0 "
                f"has {list(names)}, point {index} has {list(point)}."
            )
        checked.append({name: _values(name, [point[name]])[0] for name in names})
    return tuple(checked)
