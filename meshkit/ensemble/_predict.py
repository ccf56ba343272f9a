"""Ensemble predictions (the average of member probabilities) and per-example metrics."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshkit._types import PerExampleFn
from meshkit.ensemble._layout import EnsembleLayout
from meshkit.ensemble._metrics import member_metric_name
from meshkit.ensemble._strategy import MemberStrategy, map_members, resolve_strategy
from meshkit.train import TrainState, apply_model


def _member_logits(
    layout: EnsembleLayout, strategy: MemberStrategy
) -> Callable[[TrainState, jax.Array], jax.Array]:
    """``(state, inputs) -> logits [K, rows, ...]``: each member in inference mode."""
    resolved = resolve_strategy(strategy, layout)

    def member_logits(member: TrainState, inputs: jax.Array) -> jax.Array:
        logits, _ = apply_model(member, inputs)
        return logits

    def body(state: TrainState, inputs: jax.Array) -> jax.Array:
        return map_members(
            member_logits, resolved, layout.members_per_device, state, inputs, in_axes=(0, None)
        )

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(layout.member_spec, layout.batch_spec),
        out_specs=PartitionSpec(layout.ensemble_axis, layout.batch_axis),
    )


@functools.lru_cache(maxsize=32)
def make_predict(
    layout: EnsembleLayout, strategy: MemberStrategy = "auto"
) -> Callable[[TrainState, jax.Array], tuple[jax.Array, jax.Array]]:
    """A jitted ``predict(state, inputs) -> (probabilities, member_logits)``.

    ``inputs`` is a batch sharded like ``layout.batch_sharding`` (e.g. from
    ``meshkit.shard_batch``). ``probabilities`` (``[rows, classes]``, split over
    ``data``) is the ensemble's prediction: the average of the K members' softmax
    probabilities, as in the Flax ensembling HOWTO's ``pmap`` program; ``member_logits``
    (``[K, rows, classes]``, split over ``ensemble`` and ``data``) holds every member's
    own output. Members run in inference mode, batched or one after the other as
    ``strategy`` says (see ``make_ensemble_step``). The same function is returned for
    equal arguments.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 3)
        >>> model = train.linen_model(nn.Dense(10), jnp.zeros((1, 4)))
        >>> state = ensemble.create_ensemble_state(model, optax.sgd(0.1), layout)
        >>> inputs = meshkit.shard_batch(np.ones((8, 4), np.float32), layout.batch_sharding)
        >>> probs, logits = ensemble.make_predict(layout)(state, inputs)
        >>> probs.shape, logits.shape, bool(jnp.allclose(probs.sum(-1), 1.0))
        ((8, 10), (3, 8, 10), True)
    """
    forward = _member_logits(layout, strategy)

    def ensemble_predict(state: TrainState, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits_KxBxC = forward(state, inputs)
        return jax.nn.softmax(logits_KxBxC).mean(axis=0), logits_KxBxC

    return jax.jit(
        ensemble_predict,
        out_shardings=(
            NamedSharding(layout.mesh, PartitionSpec(layout.batch_axis)),
            NamedSharding(layout.mesh, PartitionSpec(layout.ensemble_axis, layout.batch_axis)),
        ),
    )


def classification_values(logits_KxBxC: jax.Array, labels_B: jax.Array) -> dict[str, jax.Array]:
    """Per-example losses and correctness of each member and of the ensemble.

    The ensemble's probability of a class is the mean of the members'; its loss is
    ``-log`` of that mean at the label, computed as ``logsumexp`` of the members'
    log-probabilities minus ``log K`` (no underflow).

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.array([[[2.0, 0.0]], [[0.0, 1.0]]])  # 2 members, 1 example
        >>> values = classification_values(logits, jnp.array([0]))
        >>> [round(float(values[k][0]), 3) for k in ("ensemble_loss", "loss")]
        [0.554, 0.72]
        >>> float(values["member_1/accuracy"][0])
        0.0
    """
    num_members = logits_KxBxC.shape[0]
    logp_KxBxC = jax.nn.log_softmax(logits_KxBxC)
    logp_label_KxB = jnp.take_along_axis(logp_KxBxC, labels_B[None, :, None], axis=-1)[..., 0]
    correct_KxB = (jnp.argmax(logits_KxBxC, -1) == labels_B).astype(jnp.float32)
    ensemble_logp_B = jax.nn.logsumexp(logp_label_KxB, axis=0) - math.log(num_members)
    probs_BxC = jnp.exp(logp_KxBxC).mean(axis=0)
    values = {
        "ensemble_loss": -ensemble_logp_B,
        "ensemble_accuracy": (jnp.argmax(probs_BxC, -1) == labels_B).astype(jnp.float32),
        "loss": -logp_label_KxB.mean(axis=0),
        "accuracy": correct_KxB.mean(axis=0),
    }
    for index in range(num_members):
        values[member_metric_name(index, "loss")] = -logp_label_KxB[index]
        values[member_metric_name(index, "accuracy")] = correct_KxB[index]
    return values


@functools.lru_cache(maxsize=32)
def ensemble_metrics(layout: EnsembleLayout, strategy: MemberStrategy = "auto") -> PerExampleFn:
    """The per-example function that evaluates an ensemble, for ``full_eval`` and ``fit``.

    ``fn(state, batch) -> {name: [rows]}`` on ``batch["image"]`` / ``batch["label"]``,
    with members in inference mode (see ``classification_values``):
    ``ensemble_loss`` and ``ensemble_accuracy`` (the averaged probabilities), ``loss``
    and ``accuracy`` (the members' means), and ``member_<i>/loss`` and
    ``member_<i>/accuracy``. ``meshkit.evaluate.full_eval`` masks the padding and
    averages each over the whole split; pass it to ``meshkit.train.fit`` as
    ``per_example_fn``. Members run as ``strategy`` says (see ``make_ensemble_step``).
    The same function is returned for equal arguments, so the eval step compiles once.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, evaluate, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 2)
        >>> model = train.linen_model(nn.Dense(10), jnp.zeros((1, 4)))
        >>> state = ensemble.create_ensemble_state(model, optax.sgd(0.1), layout)
        >>> arrays = {"image": np.ones((20, 4), np.float32), "label": np.zeros(20, np.int32)}
        >>> result = evaluate.full_eval(ensemble.ensemble_metrics(layout), state, arrays,
        ...                             mesh=layout.mesh, batch_size=8)
        >>> result.count, sorted(result.metrics)[:3]
        (20, ['accuracy', 'ensemble_accuracy', 'ensemble_loss'])
    """
    forward = _member_logits(layout, strategy)

    def ensemble_per_example(
        state: TrainState, batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        return classification_values(forward(state, batch["image"]), batch["label"])

    return ensemble_per_example
