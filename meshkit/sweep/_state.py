"""A sweep's state: K members on the ensemble axis, each with its own hyperparameters."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from meshkit.ensemble import EnsembleLayout
from meshkit.sweep._space import SEED_NAMES, Point, Value, check_points
from meshkit.sweep._values import (
    optimizer_hyperparameters,
    set_hyperparameters,
    with_sweep_values,
)
from meshkit.train import Model, Precision, TrainState
from meshkit.train._state import init_state_from_key


def split_names(
    points: Sequence[Point],
    tx: optax.GradientTransformation,
    model: Model,
    loss_values: Sequence[str],
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The points' names split into the optimizer's and the loss's; unknown names raise."""
    shapes = jax.eval_shape(lambda: init_state_from_key(model, tx, jax.random.key(0)))
    optimizer_names = set(optimizer_hyperparameters(shapes.opt_state))
    names = [name for name in points[0] if name not in SEED_NAMES]
    unknown = [n for n in names if n not in optimizer_names and n not in loss_values]
    if unknown:
        raise ValueError(
            f"The sweep names {unknown}, which the optimizer does not have: its "
            f"hyperparameters are {sorted(optimizer_names) or 'none'}. Wrap the optimizer "
            "in optax.inject_hyperparams (e.g. optax.inject_hyperparams(optax.adamw)"
            "(learning_rate=1e-3)) to sweep its arguments, or name a value the loss reads "
            f"in loss_values= (given: {list(loss_values)})."
        )
    clash = sorted(set(loss_values) & optimizer_names)
    if clash:
        raise ValueError(
            f"loss_values {clash} are also hyperparameters of the optimizer: rename the "
            "loss's values so that each name means one thing."
        )
    return (
        tuple(n for n in names if n in optimizer_names),
        tuple(n for n in names if n not in optimizer_names),
    )


@functools.lru_cache(maxsize=16)
def sweep_optimizer(
    tx: optax.GradientTransformation, loss_names: tuple[str, ...]
) -> optax.GradientTransformation:
    """``tx`` carrying the loss's values: one object per ``(tx, names)``, so a second sweep
    of the same space reuses every compiled program."""
    return with_sweep_values(tx, dict.fromkeys(loss_names, 0.0))


def value_arrays(points: Sequence[Point], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Each name's values over the members, ``[K]`` float32 (cast to the leaf's dtype later)."""
    return {name: np.asarray([p[name] for p in points], np.float32) for name in names}


def init_keys(points: Sequence[Point], seed: int) -> np.ndarray:
    """Each member's init seed: its ``init_seed``, else ``seed`` (all members alike)."""
    return np.asarray([int(p.get("init_seed", seed)) for p in points], np.uint32)


def init_members(
    model: Model, tx: optax.GradientTransformation, seeds: jax.Array, precision: Precision
) -> TrainState:
    """Stacked fresh members, member ``k`` initialised as ``create_train_state(seed=seeds[k])``."""
    return jax.lax.map(
        lambda seed: init_state_from_key(model, tx, jax.random.key(seed), precision=precision),
        seeds,
    )


@functools.lru_cache(maxsize=16)
def _create(
    model: Model, tx: optax.GradientTransformation, layout: EnsembleLayout, precision: Precision
) -> Any:
    def create(seeds: jax.Array, values: Mapping[str, jax.Array]) -> TrainState:
        state = init_members(model, tx, seeds, precision)
        return state.replace(opt_state=set_hyperparameters(state.opt_state, values))

    return jax.jit(create, out_shardings=layout.state_sharding)


def check_layout_holds(points: Sequence[object], layout: EnsembleLayout) -> None:
    """Raises unless ``layout`` holds one member per point."""
    if len(points) != layout.num_members:
        raise ValueError(
            f"The sweep has {len(points)} points but the layout holds "
            f"{layout.num_members} members ({layout!r}). Build the layout with "
            f"EnsembleLayout(mesh, {len(points)})."
        )


def create_sweep_state(
    model: Model,
    tx: optax.GradientTransformation,
    layout: EnsembleLayout,
    points: Sequence[Mapping[str, Value]],
    *,
    loss_values: Sequence[str] = (),
    seed: int = 0,
    precision: Precision | str | None = None,
) -> TrainState:
    """K members on the ensemble axis, member ``k`` set to ``points[k]``.

    Member ``k`` is the train state ``create_train_state(model, tx, seed=s)`` would make,
    with ``s`` its point's ``init_seed`` (else ``seed``, the same start for every
    member), its ``inject_hyperparams`` hyperparameters set to the point's values, and
    the point's loss values (``loss_values`` names them; read them with
    ``hyperparameter``) carried beside them (``with_sweep_values``). Values are arrays
    on the member axis: a sweep with other values of the same names reuses every
    compiled program.

    Raises:
      ValueError: no points; a point naming a hyperparameter the optimizer does not
        have (the error lists those it has); a non-finite value; K not what the
        layout holds.

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, sweep, train
        >>> points = sweep.Space(learning_rate=[0.1, 0.01]).grid()
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 2)
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> state = sweep.create_sweep_state(model, tx, layout, points)
        >>> meshkit.to_host(sweep.hyperparameter(state, "learning_rate")).tolist()
        [0.10000000149011612, 0.009999999776482582]
    """
    checked = check_points(points)
    check_layout_holds(checked, layout)
    optimizer_names, loss_names = split_names(checked, tx, model, tuple(loss_values))
    swept_tx = sweep_optimizer(tx, loss_names)
    values = value_arrays(checked, optimizer_names + loss_names)
    return _create(model, swept_tx, layout, Precision.of(precision))(
        init_keys(checked, seed), values
    )
