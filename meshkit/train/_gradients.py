"""The one gradient core every train step calls: gradients, then the update.

``gradients`` differentiates a loss function on one batch: the loss scale (float16),
micro-batch accumulation and the per-micro-batch dropout keys live here.
``apply_update`` turns those gradients into the next state and the step's metrics:
the optimizer update, the overflow skip of float16 and the gradient norm. The
data-parallel step (``make_train_step``) is the two in a row; the ensemble step runs
``gradients`` per member, averages over its data axis, and maps ``apply_update`` over
the members. A step feature written here reaches both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from meshkit._batch import leading_dim_shards
from meshkit._checks import check_int
from meshkit._specs import spec_axis_names
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


class Gradients(NamedTuple):
    """One batch's loss, what the loss function returned beside it, and the gradients.

    Attributes:
      loss: the (unscaled) loss, averaged over micro-batches.
      output: the loss function's ``LossOutput`` (for an ensemble member, its
        ``MemberOutput``): collections after the last micro-batch, metrics averaged.
      grads: float32 gradients w.r.t. the state's parameters, averaged over
        micro-batches; non-finite when a float16 backward pass overflowed.
    """

    loss: jax.Array
    output: Any
    grads: Any


def gradients(
    loss_fn: Callable[[Any, TrainState, Batch, jax.Array], tuple[jax.Array, Any]],
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    microbatches: int = 1,
    batch_sharding: NamedSharding | None = None,
    unroll: bool | None = None,
) -> Gradients:
    """The gradients of ``loss_fn`` at ``state.params`` on ``batch``, inside a jitted step.

    ``loss_fn`` is a ``LossFn``: ``(params, state, batch, rng) -> (loss, output)``,
    where ``output`` is a ``LossOutput`` (or another ``NamedTuple`` with its
    ``collections`` and ``metrics``, such as an ensemble member's ``MemberOutput``).

    With a loss scale in the state (float16 compute) the loss is multiplied by the
    scale before the backward pass and the gradients divided by it again. With
    ``microbatches=k`` the batch is split into k micro-batches (micro-batch ``i`` is
    every k-th row from ``i``, so each is spread over every device of
    ``batch_sharding`` and the split moves no data) run one after another by a
    ``lax.scan``; each draws its own dropout
    key (``fold_in(rng, i)``) and sees the collections the previous one updated.
    ``unroll`` chooses straight-line code over one loop for the micro-batches; by
    default ``unrolls_microbatches`` of the batch's platform decides (the two give the
    same results).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import train
        >>> model = train.linen_model(nn.Dense(2), jnp.zeros((1, 3)))
        >>> state = train.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=-1"))
        >>> batch = {"image": jnp.ones((8, 3)), "label": jnp.zeros(8, jnp.int32)}
        >>> from meshkit.train.parts import gradients
        >>> whole = gradients(train.classification_loss, state, batch, jax.random.key(0))
        >>> split = gradients(train.classification_loss, state, batch,
        ...                   jax.random.key(0), microbatches=4)
        >>> bool(jnp.allclose(whole.grads["kernel"], split.grads["kernel"], atol=1e-6))
        True
    """
    check_int(microbatches, name="microbatches", minimum=1)
    if microbatches == 1:
        return _gradients(loss_fn, state, batch, rng)
    if unroll is None:
        devices = jax.devices() if batch_sharding is None else batch_sharding.device_set
        unroll = unrolls_microbatches(next(iter(devices)).platform)
    parts = _split_batch(batch, microbatches, batch_sharding)
    return _accumulated(loss_fn, state, parts, rng, unroll=unroll)


def ordered_gradients(
    loss_fn: Callable[[Any, TrainState, Batch, jax.Array], tuple[jax.Array, Any]],
    state: TrainState,
    batch: Batch,
    rng: jax.Array,
    *,
    batch_sharding: NamedSharding,
    microbatches: int = 1,
    unroll: bool | None = None,
) -> Gradients:
    """``gradients``, with the sum over devices in a fixed order: the same bits on any
    process layout of the mesh.

    The default step leaves the sum of the devices' gradients to the compiler's
    all-reduce, whose order of additions depends on the runtime (one process's
    devices, or several processes over the network), so 1 process × 8 devices and
    2 × 4 agree only to rounding. Here each device differentiates the loss on its own
    rows (a ``shard_map`` over the batch's data axes, so each device runs the ordinary
    single-device program), the results are gathered on every device (an all-gather
    only copies) and every device adds them in shard order: the same program whatever
    the layout. The cost: every device receives and holds all ``D`` gradients (``D``
    = the batch's data shards) instead of their all-reduced sum.

    Two things differ from the default step, by design: the loss function sees one
    device's rows at a time, so batch statistics (batch norm) are those of a device's
    rows, averaged over the devices, as a ``pmap`` without ``axis_name`` computes
    them; and shard ``i`` draws its dropout key as ``fold_in(rng, i)``.
    """
    axes = spec_axis_names(batch_sharding.spec[:1])
    shards = leading_dim_shards(batch_sharding)

    def on_each_device(state: TrainState, batch: Batch, rng: jax.Array) -> Gradients:
        index = jax.lax.axis_index(axes) if axes else 0
        local = gradients(
            loss_fn,
            state,
            batch,
            jax.random.fold_in(rng, index),
            microbatches=microbatches,
            unroll=unroll,
        )
        if not axes:
            return local
        stacked = jax.lax.all_gather(local, axes)  # shard order along a new leading axis
        return jax.tree.map(lambda leaf: _ordered_mean(leaf, shards), stacked)

    everywhere = PartitionSpec()
    batch_spec = PartitionSpec(batch_sharding.spec[0]) if axes else everywhere
    return jax.shard_map(
        on_each_device,
        mesh=batch_sharding.mesh,
        in_specs=(everywhere, batch_spec, everywhere),
        out_specs=everywhere,
        # Every device adds the same gathered values in the same order, so the result
        # is replicated; this JAX cannot infer that of an all-gather by itself.
        check_vma=False,
    )(state, batch, rng)


def _ordered_mean(stacked: jax.Array, shards: int) -> jax.Array:
    """The mean over the leading axis, added in index order (integers: the first group's)."""
    if not jnp.issubdtype(stacked.dtype, jnp.inexact):
        return stacked[0]
    total = stacked[0]
    for index in range(1, shards):
        total = total + stacked[index]
    return (total / shards).astype(stacked.dtype)


def _gradients(
    loss_fn: Callable[..., Any], state: TrainState, batch: Batch, rng: jax.Array
) -> Gradients:
    scale = None if state.loss_scale is None else state.loss_scale.scale

    def scaled(params: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        loss, out = loss_fn(params, state, batch, rng)
        return (loss if scale is None else loss * scale), (loss, out)

    (_, (loss, out)), grads = jax.value_and_grad(scaled, has_aux=True)(state.params)
    if scale is not None:
        grads = jax.tree.map(lambda grad: grad / scale, grads)
    return Gradients(loss, out, grads)


def _rows_in_shards(batch: Batch, microbatches: int, sharding: NamedSharding | None) -> None:
    """Trace-time check: the batch splits into equal micro-batches spread over every shard."""
    for key, value in batch.items():
        rows = value.shape[0] if value.shape else 0
        check_microbatch_rows(rows, microbatches, sharding, what=f"Batch field {key!r} has")


def check_microbatch_rows(
    rows: int, microbatches: int, sharding: NamedSharding | None, *, what: str
) -> None:
    """Raises unless ``rows`` split into ``microbatches`` equal micro-batches spread over
    every shard of ``sharding``'s leading dimension (``fit`` checks before compiling)."""
    shards = 1 if sharding is None else leading_dim_shards(sharding)
    if rows % (microbatches * shards):
        raise ValueError(
            f"{what} {rows} rows, which do not split into "
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


def _accumulated(
    loss_fn: Callable[..., Any], state: TrainState, parts: Batch, rng: jax.Array, *, unroll: bool
) -> Gradients:
    """``_gradients`` averaged over the leading micro-batch axis of ``parts``."""
    microbatches = next(iter(parts.values())).shape[0]

    def accumulate(
        carry: tuple[Any, dict[str, Any]], xs: tuple[jax.Array, Batch]
    ) -> tuple[tuple[Any, dict[str, Any]], tuple[jax.Array, Any]]:
        grads_sum, collections = carry
        index, part = xs
        member = state.replace(collections=collections)
        loss, out, grads = _gradients(loss_fn, member, part, jax.random.fold_in(rng, index))
        if out.collections:
            collections = _like(collections, out.collections)
        out = out._replace(collections={})  # carried instead of stacked
        return (jax.tree.map(jnp.add, grads_sum, grads), collections), (loss, out)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, collections), (losses, outs) = jax.lax.scan(
        accumulate,
        (zeros, dict(state.collections)),
        (jnp.arange(microbatches), parts),
        unroll=microbatches if unroll else 1,
    )
    grads = jax.tree.map(lambda total: total / microbatches, grads)
    # Metrics are averaged over the micro-batches; per-row outputs (an ensemble
    # member's logits) are put back in the batch's row order.
    merged = {
        field: jax.tree.map(lambda stacked: _rows_in_order(stacked, microbatches), value)
        for field, value in outs._asdict().items()
        if field not in ("collections", "metrics")
    }
    metrics = {name: values.mean(0) for name, values in outs.metrics.items()}
    out = outs._replace(collections=collections, metrics=metrics, **merged)
    return Gradients(losses.mean(), out, grads)


def _rows_in_order(stacked: jax.Array, microbatches: int) -> jax.Array:
    """``[k, rows / k, ...]`` from the scan as ``[rows, ...]``: row ``r·k + i`` came from
    micro-batch ``i`` (``_split_batch``)."""
    rows = stacked.swapaxes(0, 1)
    return rows.reshape(rows.shape[0] * microbatches, *rows.shape[2:])


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


def apply_update(state: TrainState, grads: Gradients) -> tuple[TrainState, Metrics]:
    """The next state after one optimizer update with ``grads``, and the step's metrics.

    The metrics are ``loss``, ``grad_norm`` and the loss function's own metrics. With
    a loss scale in the state (float16), a step whose gradients overflowed is skipped:
    the step still counts, the parameters, optimizer state and collections stay as
    they were, the scale halves (``LossScale.adjust``), ``grad_norm`` is 0 and the
    metrics add ``skipped`` (1 for a skipped step) and ``loss_scale``. Pure and
    element-wise over the state, so ``jax.vmap`` maps it over stacked members.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import train
        >>> model = train.linen_model(nn.Dense(2), jnp.zeros((1, 3)))
        >>> state = train.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=-1"),
        ...                                  precision="f16")
        >>> batch = {"image": jnp.ones((8, 3)), "label": jnp.zeros(8, jnp.int32)}
        >>> from meshkit.train.parts import apply_update, gradients
        >>> grads = gradients(train.classification_loss, state, batch, jax.random.key(0))
        >>> overflowed = grads._replace(grads=jax.tree.map(lambda g: g * jnp.inf, grads.grads))
        >>> new, metrics = apply_update(state, overflowed)
        >>> int(new.step), float(metrics["skipped"]), float(metrics["loss_scale"])
        (1, 1.0, 32768.0)
        >>> bool((new.params["kernel"] == state.params["kernel"]).all())
        True
    """
    out = grads.output
    new_state = state.apply_gradients(grads.grads, out.collections or None)
    grad_norm = optax.tree.norm(grads.grads)
    extra: Metrics = {}
    if state.loss_scale is not None:
        new_state, extra = _skip_if_overflowed(new_state, state, grads.grads)
        grad_norm = jnp.where(extra["skipped"] > 0, 0.0, grad_norm)
    return new_state, {"loss": grads.loss, "grad_norm": grad_norm, **out.metrics, **extra}


def _skip_if_overflowed(new: TrainState, old: TrainState, grads: Any) -> tuple[TrainState, Metrics]:
    """With loss scaling: ``new``, or ``old``'s values when the gradients overflowed."""
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
