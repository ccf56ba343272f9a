"""The jitted train step: shardings at the boundary, state donated, no pmean."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from meshkit._batch import leading_dim_shards
from meshkit._checks import check_int
from meshkit._host import replicated_sharding
from meshkit._types import Batch, Metrics
from meshkit.train._state import TrainState


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


def apply_model(
    state: TrainState, inputs: Any, *, params: Any | None = None, rng: jax.Array | None = None
) -> tuple[Any, dict[str, Any]]:
    """The model's outputs on ``inputs``, and its updated mutable collections.

    With ``rng`` (this step's dropout key, ``state.step_rng()``) the model runs in
    training mode: dropout on, and every mutable collection of the state
    (``batch_stats``, an NNX model's ``state``) updated and returned, ready for
    ``LossOutput.collections``. Without ``rng`` it runs in inference mode and the
    collections come back ``{}`` (the state's stay as they are). ``params`` replaces
    the state's parameters: pass the argument a loss function is differentiated by.

    The state's precision policy applies here: with ``"bf16"`` or ``"f16"`` the
    parameters and floating-point inputs are cast to that dtype for the call and the
    outputs come back as float32; mutable collections (batch statistics) stay float32.
    So do the state's activation rules: inside the call, ``nn.with_logical_constraint``
    resolves logical names through the logical table the state was created with, so
    evaluation functions built on ``apply_model`` shard activations as training does.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, meshkit
        >>> from meshkit.models import NormCNN
        >>> from meshkit.train import apply_model, create_train_state, linen_model
        >>> model = linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
        >>> state = create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=-1"))
        >>> logits, collections = apply_model(state, jnp.ones((4, 8, 8, 1)),
        ...                                   rng=jax.random.key(0))
        >>> logits.shape, sorted(collections)
        ((4, 10), ['batch_stats'])
        >>> apply_model(state, jnp.ones((4, 8, 8, 1)))[1]
        {}
    """
    training = rng is not None
    mutable = (list(state.collections) or False) if training else False
    policy = state.precision
    params = state.params if params is None else params
    with state.logical_scope():
        out = state.apply_fn(
            {"params": policy.to_compute(params), **state.collections},
            policy.to_compute(inputs),
            train=training,
            rngs={"dropout": rng} if training else None,
            mutable=mutable,
        )
    outputs, collections = out if mutable else (out, {})
    return policy.to_output(outputs), dict(collections)


def classification_loss(
    params: Any, state: TrainState, batch: Batch, rng: jax.Array
) -> tuple[jax.Array, LossOutput]:
    """Softmax cross-entropy on ``batch["image"]`` / ``batch["label"]``, with accuracy.

    Runs the model in training mode (dropout on, batch statistics updated). Batch
    statistics are computed over the whole global batch: the batch is one sharded
    array, so the compiler reduces across devices where needed.
    """
    logits, collections = apply_model(state, batch["image"], params=params, rng=rng)
    labels = batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, LossOutput(collections=collections, metrics={"accuracy": accuracy})


def classification_metrics(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    """Per-example cross-entropy and correctness, in inference mode (for evaluation)."""
    logits, _ = apply_model(state, batch["image"])
    labels = batch["label"]
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
        "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
    }


def _gradients(
    loss_fn: LossFn, state: TrainState, batch: Batch, rng: jax.Array
) -> tuple[jax.Array, LossOutput, Any]:
    """The loss, its ``LossOutput`` and the float32 gradients on one batch.

    With a loss scale (float16 compute) the loss is multiplied by the scale before the
    backward pass and the gradients are divided by it again; they are non-finite when
    the scaled backward pass overflowed.
    """
    scale = None if state.loss_scale is None else state.loss_scale.scale

    def scaled(params: Any) -> tuple[jax.Array, tuple[jax.Array, LossOutput]]:
        loss, out = loss_fn(params, state, batch, rng)
        return (loss if scale is None else loss * scale), (loss, out)

    (_, (loss, out)), grads = jax.value_and_grad(scaled, has_aux=True)(state.params)
    if scale is not None:
        grads = jax.tree.map(lambda grad: grad / scale, grads)
    return loss, out, grads


def _rows_in_shards(batch: Batch, microbatches: int, sharding: NamedSharding | None) -> None:
    """Trace-time check: the batch splits into equal micro-batches spread over every shard."""
    shards = 1 if sharding is None else leading_dim_shards(sharding)
    for key, value in batch.items():
        rows = value.shape[0] if value.shape else 0
        if rows % (microbatches * shards):
            raise ValueError(
                f"Batch field {key!r} has {rows} rows, which do not split into "
                f"microbatches={microbatches} micro-batches of equal size spread over the "
                f"{shards} devices the batch is split over: the global batch size must be a "
                f"multiple of {microbatches} × {shards} = {microbatches * shards}. Change "
                "the batch size or the number of micro-batches."
            )


def _split_batch(batch: Batch, microbatches: int, sharding: NamedSharding | None) -> Batch:
    """``[rows, ...]`` fields as ``[microbatches, rows / microbatches, ...]``.

    Micro-batch ``i`` takes every ``microbatches``-th row from ``i``: each device's
    rows are a contiguous block, so every micro-batch has the same number of rows on
    every device and the split is a local reshape, with no data moved between devices.
    """
    _rows_in_shards(batch, microbatches, sharding)
    spread = None
    if sharding is not None:
        spread = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))

    def split(value: jax.Array) -> jax.Array:
        parts = value.reshape(value.shape[0] // microbatches, microbatches, *value.shape[1:])
        parts = parts.swapaxes(0, 1)
        return parts if spread is None else jax.lax.with_sharding_constraint(parts, spread)

    return {key: split(value) for key, value in batch.items()}


def _accumulated_gradients(
    loss_fn: LossFn,
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    microbatches: int,
    sharding: NamedSharding | None,
    unroll: bool,
) -> tuple[jax.Array, LossOutput, Any]:
    """``_gradients`` averaged over micro-batches, run one after another by ``lax.scan``.

    Each micro-batch draws its own dropout key (``fold_in(rng, i)``) and sees the
    mutable collections (batch statistics) the previous one updated; the loss and the
    metrics are means over the micro-batches, the gradient their mean.
    """
    parts = _split_batch(batch, microbatches, sharding)
    collections = dict(state.collections)

    def accumulate(
        carry: tuple[Any, dict[str, Any]], xs: tuple[jax.Array, Batch]
    ) -> tuple[tuple[Any, dict[str, Any]], tuple[jax.Array, dict[str, jax.Array]]]:
        grads_sum, collections = carry
        index, part = xs
        member = state.replace(collections=collections)
        loss, out, grads = _gradients(loss_fn, member, part, jax.random.fold_in(rng, index))
        if out.collections:
            collections = _like(collections, out.collections)
        return (jax.tree.map(jnp.add, grads_sum, grads), collections), (loss, dict(out.metrics))

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, collections), (losses, metrics) = jax.lax.scan(
        accumulate,
        (zeros, collections),
        (jnp.arange(microbatches), parts),
        unroll=microbatches if unroll else 1,
    )
    grads = jax.tree.map(lambda total: total / microbatches, grads)
    means = {name: values.mean(0) for name, values in metrics.items()}
    return losses.mean(), LossOutput(collections=collections, metrics=means), grads


def _like(reference: dict[str, Any], new: Any) -> dict[str, Any]:
    """``new`` collections in ``reference``'s tree types and dtypes (a ``lax.scan`` carry)."""
    leaves = jax.tree.leaves(new)
    structure = jax.tree.structure(reference)
    if len(leaves) != structure.num_leaves:
        raise ValueError(
            "With micro-batches the loss function must return every mutable collection "
            f"of the state (LossOutput.collections): the state holds {sorted(reference)}, "
            f"the loss function returned {sorted(new)}."
        )
    return jax.tree.map(
        lambda old, leaf: leaf.astype(old.dtype), reference, jax.tree.unflatten(structure, leaves)
    )


def _skip_if_overflowed(new: TrainState, old: TrainState, grads: Any) -> tuple[TrainState, Metrics]:
    """With loss scaling: ``new``, or ``old``'s values when the gradients overflowed.

    A skipped step still counts (``step`` advances); its parameters, optimizer state
    and collections are the previous ones, and the loss scale is halved.
    """
    assert old.loss_scale is not None
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(grad)) for grad in jax.tree.leaves(grads)]))
    kept = jax.tree.map(
        lambda updated, previous: jnp.where(finite, updated, previous),
        (new.params, new.opt_state, new.collections),
        (old.params, old.opt_state, old.collections),
    )
    params, opt_state, collections = kept
    state = new.replace(
        params=params,
        opt_state=opt_state,
        collections=collections,
        loss_scale=old.loss_scale.adjust(finite),
    )
    metrics = {"skipped": (~finite).astype(jnp.float32), "loss_scale": old.loss_scale.scale}
    return state, metrics


def unrolls_microbatches(platform: str) -> bool:
    """Whether micro-batches run as straight-line code on ``platform`` (else as one loop).

    XLA's CPU backend runs a convolutional network inside a loop body 6 to 13 times
    slower than the same code outside one (measured on the MNIST CNN), so on CPU the
    micro-batch loop is unrolled, at the cost of the memory saving; GPUs and TPUs keep
    one loop body, which holds one micro-batch's activations at a time.
    """
    return platform == "cpu"


def train_step_fn(
    loss_fn: LossFn,
    *,
    microbatches: int = 1,
    batch_sharding: NamedSharding | None = None,
    unroll_microbatches: bool | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The un-jitted step: gradients of ``loss_fn``, one update, metrics as device scalars.

    With ``microbatches > 1`` the batch is split into that many micro-batches whose
    gradients are accumulated (``lax.scan``) before the one update; ``batch_sharding``
    (when known) keeps every micro-batch spread over all devices. With a loss scale in
    the state (float16), a step whose gradients overflow is skipped; the metrics then
    add ``skipped`` (1 for a skipped step) and ``loss_scale``, and ``grad_norm`` is 0
    for a skipped step. ``unroll_microbatches`` chooses straight-line code over one
    loop for the micro-batches; by default ``unrolls_microbatches`` of the batch's
    platform decides (the two give the same results). The state's activation rules
    (a logical table given to ``create_train_state``) are active while the step traces.
    """
    check_int(microbatches, name="microbatches", minimum=1)
    if unroll_microbatches is None:
        platform = (
            jax.default_backend()
            if batch_sharding is None
            else next(iter(batch_sharding.device_set)).platform
        )
        unroll_microbatches = unrolls_microbatches(platform)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        with state.logical_scope():  # nn.with_logical_constraint resolves to the mesh
            return _train_step(state, batch)

    def _train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        rng = state.step_rng()
        if microbatches == 1:
            loss, out, grads = _gradients(loss_fn, state, batch, rng)
        else:
            loss, out, grads = _accumulated_gradients(
                loss_fn,
                state,
                batch,
                rng,
                microbatches=microbatches,
                sharding=batch_sharding,
                unroll=unroll_microbatches,
            )
        new_state = state.apply_gradients(grads, out.collections or None)
        grad_norm = optax.tree.norm(grads)
        extra: Metrics = {}
        if state.loss_scale is not None:
            new_state, extra = _skip_if_overflowed(new_state, state, grads)
            grad_norm = jnp.where(extra["skipped"] > 0, 0.0, grad_norm)
        metrics = {"loss": loss, "grad_norm": grad_norm, **out.metrics, **extra}
        return new_state, metrics

    return train_step


def make_train_step(
    loss_fn: LossFn,
    state_shardings: TrainState,
    batch_sharding: NamedSharding,
    *,
    microbatches: int = 1,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """A jitted ``step(state, batch) -> (state, metrics)``.

    Shardings are stated at the jit boundary: the state keeps ``state_shardings``
    (replicated or FSDP), the batch arrives split over the data axis, and metrics come
    back replicated. With replicated parameters and a sharded batch, the compiler
    inserts the gradient all-reduce that ``pmean`` used to spell out. The input state
    is donated: its buffers are reused for the new state.

    ``microbatches=k`` accumulates gradients over k micro-batches of the global batch
    inside the one jitted step (a ``lax.scan``), for a batch whose activations do not
    fit at once: one step is still one optimizer update, so ``fit``'s step counts,
    checkpoints and evaluations count updates. The global batch size must be a
    multiple of k times the devices of the data axis (on CPU the micro-batches run
    unrolled; see ``unrolls_microbatches``). The precision policy comes with
    the state (``create_train_state(..., precision="bf16")``).

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
    replicated = replicated_sharding(batch_sharding.mesh)
    return jax.jit(
        train_step_fn(loss_fn, microbatches=microbatches, batch_sharding=batch_sharding),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
