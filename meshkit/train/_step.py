"""The jitted train step: shardings at the boundary, state donated, no pmean."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from meshkit.train._state import TrainState

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]


class LossOutput(NamedTuple):
    """What a loss function returns beside the loss.

    Attributes:
      collections: updated mutable collections (``{"batch_stats": ...}``), or ``{}``.
      metrics: extra scalar metrics to report (``{"accuracy": ...}``).
    """

    collections: Mapping[str, Any]
    metrics: Mapping[str, jax.Array]


LossFn = Callable[[Any, TrainState, Batch, jax.Array], tuple[jax.Array, LossOutput]]
"""``loss_fn(params, state, batch, rng) -> (loss, LossOutput)``: differentiated w.r.t. params."""

PerExampleFn = Callable[[TrainState, Batch], Mapping[str, jax.Array]]
"""``fn(state, batch) -> {"name": values of shape [batch]}``, for evaluation."""


def _logits(state: TrainState, params: Any, inputs: jax.Array, rng: jax.Array | None) -> Any:
    mutable = (list(state.collections) or False) if rng is not None else False
    rngs = {"dropout": rng} if rng is not None else None
    out = state.apply_fn(
        state.variables(params), inputs, train=rng is not None, rngs=rngs, mutable=mutable
    )
    return out if mutable else (out, {})


def classification_loss(
    params: Any, state: TrainState, batch: Batch, rng: jax.Array
) -> tuple[jax.Array, LossOutput]:
    """Softmax cross-entropy on ``batch["image"]`` / ``batch["label"]``, with accuracy.

    Runs the model in training mode (dropout on, batch statistics updated). Batch
    statistics are computed over the whole global batch: the batch is one sharded
    array, so the compiler reduces across devices where needed.
    """
    logits, collections = _logits(state, params, batch["image"], rng)
    labels = batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, LossOutput(collections=collections, metrics={"accuracy": accuracy})


def classification_metrics(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    """Per-example cross-entropy and correctness, in inference mode (for evaluation)."""
    logits, _ = _logits(state, state.params, batch["image"], None)
    labels = batch["label"]
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
        "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
    }


def train_step_fn(loss_fn: LossFn) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The un-jitted step: gradients of ``loss_fn``, one update, metrics as device scalars."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, out), grads = grad_fn(state.params, state, batch, rng)
        new_state = state.apply_gradients(grads, out.collections or None)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **out.metrics}
        return new_state, metrics

    return train_step


def make_train_step(
    loss_fn: LossFn,
    state_shardings: TrainState,
    batch_sharding: NamedSharding,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """A jitted ``step(state, batch) -> (state, metrics)``.

    Shardings are stated at the jit boundary: the state keeps ``state_shardings``
    (replicated or FSDP), the batch arrives split over the data axis, and metrics come
    back replicated. With replicated parameters and a sharded batch, the compiler
    inserts the gradient all-reduce that ``pmean`` used to spell out. The input state
    is donated: its buffers are reused for the new state.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, meshkit
        >>> from meshkit.models import CifarNet
        >>> from meshkit.train import (classification_loss, create_train_state,
        ...                            linen_model, make_train_step, state_shardings_of)
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> state = create_train_state(linen_model(CifarNet(), jnp.zeros((1, 32, 32, 3))),
        ...                            optax.sgd(0.1), mesh)
        >>> sharding = meshkit.batch_sharding(mesh)
        >>> step = make_train_step(classification_loss, state_shardings_of(state), sharding)
        >>> batch = meshkit.shard_batch({"image": np.zeros((8, 32, 32, 3), np.float32),
        ...                              "label": np.zeros(8, np.int32)}, sharding)
        >>> state, metrics = step(state, batch)
        >>> int(state.step), sorted(metrics)
        (1, ['accuracy', 'grad_norm', 'loss'])
    """
    replicated = NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(
        train_step_fn(loss_fn),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
