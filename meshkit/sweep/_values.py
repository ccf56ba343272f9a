"""Where a member's hyperparameters live: in its optimizer state, as arrays.

Optimizer hyperparameters are those of ``optax.inject_hyperparams``, kept in the
optimizer state. Scalars the loss reads (label smoothing, an L2 coefficient) are kept
beside them by ``with_sweep_values``, which also carries the member's ``active`` flag
(a stopped member keeps its parameters and optimizer state) and its divergence count
(a member whose gradients stop being finite is frozen the same way, for good). As
arrays on the member axis, new values never recompile the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

_INJECT_STATES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


class SweepValues(NamedTuple):
    """The optimizer state of ``with_sweep_values``.

    Attributes:
      inner: the wrapped optimizer's state.
      values: the loss's hyperparameters.
      active: whether the member trains (``False``: halving stopped it).
      diverged_steps: ``0`` while the member's gradients have been finite; from the
        first update whose gradients were not, the number of updates since, that one
        included (the member diverged ``diverged_steps - 1`` steps before the latest).
    """

    inner: Any
    values: dict[str, jax.Array]
    active: jax.Array
    diverged_steps: jax.Array


def with_sweep_values(
    tx: optax.GradientTransformation, values: Mapping[str, float]
) -> optax.GradientTransformation:
    """``tx``, carrying the loss's hyperparameters ``values`` and an ``active`` flag.

    The updates are ``tx``'s while ``active`` is true; a member that is not active gets
    zero updates and keeps its optimizer state (a sweep's stopped member). An active
    member whose gradients are not all finite (its loss went NaN or infinite) is frozen
    the same way from that update on, and counts the updates since in
    ``diverged_steps``; the other members of the step are not touched. (With float16
    loss scaling the train step skips an overflowing update before this sees it, so an
    overflow does not count as divergence.) ``hyperparameter(state, name)`` reads the
    values inside a loss function.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> tx = with_sweep_values(optax.sgd(0.1), {"label_smoothing": 0.1})
        >>> state = tx.init({"w": jnp.zeros(2)})
        >>> round(float(state.values["label_smoothing"]), 6), bool(state.active)
        (0.1, True)
        >>> updates, _ = tx.update({"w": jnp.ones(2)}, state._replace(active=jnp.array(False)))
        >>> updates["w"].tolist()
        [0.0, 0.0]
        >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state)
        >>> updates["w"].tolist(), int(state.diverged_steps)
        ([0.0, 0.0], 1)
    """
    defaults = {name: float(value) for name, value in values.items()}

    def init(params: Any) -> SweepValues:
        return SweepValues(
            tx.init(params),
            {name: jnp.asarray(value, jnp.float32) for name, value in defaults.items()},
            jnp.asarray(True),
            jnp.asarray(0, jnp.int32),
        )

    def update(updates: Any, state: SweepValues, params: Any = None) -> tuple[Any, SweepValues]:
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
        was_diverged = state.diverged_steps > 0
        diverged_steps = jnp.where(
            was_diverged | (state.active & ~finite), state.diverged_steps + 1, 0
        ).astype(jnp.int32)
        trains = state.active & (diverged_steps == 0)
        new_updates, inner = tx.update(updates, state.inner, params)
        new_updates = jax.tree.map(lambda u: jnp.where(trains, u, jnp.zeros_like(u)), new_updates)
        inner = jax.tree.map(lambda new, old: jnp.where(trains, new, old), inner, state.inner)
        return new_updates, state._replace(inner=inner, diverged_steps=diverged_steps)

    return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


def _is_holder(node: Any) -> bool:
    return isinstance(node, (SweepValues, *_INJECT_STATES))


def optimizer_hyperparameters(opt_state: Any) -> dict[str, Any]:
    """Every hyperparameter the optimizer state holds: ``inject_hyperparams``' and the loss's."""
    found: dict[str, Any] = {}

    def visit(node: Any) -> Any:
        if isinstance(node, SweepValues):
            found.update(node.values)
            jax.tree.map(visit, node.inner, is_leaf=_is_holder)
        elif isinstance(node, _INJECT_STATES):
            found.update(node.hyperparams)
            jax.tree.map(visit, node.inner_state, is_leaf=_is_holder)
        return node

    jax.tree.map(visit, opt_state, is_leaf=_is_holder)
    return found


def diverged_steps(opt_state: Any) -> jax.Array | None:
    """The ``diverged_steps`` of ``with_sweep_values`` in ``opt_state`` (``[K]`` for a
    sweep's members), or ``None`` when it holds none."""
    found = [
        node.diverged_steps
        for node in jax.tree.leaves(opt_state, is_leaf=_is_holder)
        if isinstance(node, SweepValues)
    ]
    return found[0] if found else None


def set_hyperparameters(
    opt_state: Any, values: Mapping[str, jax.Array], active: jax.Array | None = None
) -> Any:
    """``opt_state`` with the named hyperparameters (and the ``active`` flag) replaced.

    Each value is cast to the dtype of the leaf it replaces, so an int hyperparameter
    (a warm-up length) stays an int.
    """

    def replaced(held: Mapping[str, Any]) -> dict[str, Any]:
        return {
            name: jnp.asarray(values[name]).astype(leaf.dtype) if name in values else leaf
            for name, leaf in held.items()
        }

    def visit(node: Any) -> Any:
        if isinstance(node, SweepValues):
            return node._replace(
                inner=jax.tree.map(visit, node.inner, is_leaf=_is_holder),
                values=replaced(node.values),
                active=node.active if active is None else active,
            )
        if isinstance(node, _INJECT_STATES):
            return node._replace(
                hyperparams=replaced(node.hyperparams),
                inner_state=jax.tree.map(visit, node.inner_state, is_leaf=_is_holder),
            )
        return node

    return jax.tree.map(visit, opt_state, is_leaf=_is_holder)


def hyperparameter(state: Any, name: str) -> jax.Array:
    """A member's hyperparameter ``name``, read from its state (in a loss function).

    ``state`` is the train state a loss function receives (one member's); ``name`` is
    one of the sweep's points' names: an ``inject_hyperparams`` hyperparameter or one
    of the loss's values.

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import train
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> tx = with_sweep_values(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        ...                        {"label_smoothing": 0.1})
        >>> state = train.create_train_state(model, tx, meshkit.make_mesh("data=-1"))
        >>> names = ("label_smoothing", "learning_rate")
        >>> [round(float(hyperparameter(state, name)), 6) for name in names]
        [0.1, 0.1]
    """
    held = optimizer_hyperparameters(state.opt_state)
    if name not in held:
        raise KeyError(
            f"The state holds no hyperparameter {name!r}; it holds {sorted(held)}. Sweep "
            "it (a name of the sweep's points), or read a constant instead."
        )
    return held[name]


def warmup_cosine(
    peak_value: jax.Array | float,
    warmup_steps: jax.Array | int,
    decay_steps: int,
    end_value: float = 0.0,
) -> optax.Schedule:
    """A linear warm-up to ``peak_value``, then a cosine decay to ``end_value``.

    Like ``optax.warmup_cosine_decay_schedule`` (from 0), but ``peak_value`` and
    ``warmup_steps`` may be traced arrays, so ``optax.inject_hyperparams`` can sweep
    them: ``inject_hyperparams(lambda peak, warmup: optax.adamw(warmup_cosine(peak,
    warmup, 1000)))(peak=1e-3, warmup=100)``.

    Examples:
        >>> schedule = warmup_cosine(1.0, 10, 110)
        >>> [round(float(schedule(s)), 3) for s in (0, 5, 10, 60, 110)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    def schedule(count: ArrayLike) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        warmup = jnp.maximum(jnp.asarray(warmup_steps, jnp.float32), 1.0)
        rising = peak_value * count / warmup
        span = jnp.maximum(decay_steps - warmup, 1.0)
        progress = jnp.clip((count - warmup) / span, 0.0, 1.0)
        falling = end_value + (peak_value - end_value) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, rising, falling)

    return schedule
