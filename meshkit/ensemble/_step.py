"""The ensemble train step: one jit around a shard_map that trains each device's members.

Inside the ``shard_map`` each device holds ``m = K / E`` members and its rows of the
batch. How the members run is a per-backend choice (``strategy``): batched with
``vmap`` on GPUs and TPUs, where the grouped convolutions it makes are fast; one after
the other on CPUs (a Python loop, unrolled at trace time), so each forward and backward
pass is the ordinary network and its convolutions stay plain convolutions, which
XLA:CPU runs far faster (see the ensembles guide for the measurements). The optimizer
update, which is element-wise, is vectorised over the local members either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from meshkit._checks import check_int
from meshkit._host import replicated_sharding
from meshkit._types import Batch, Metrics
from meshkit.ensemble._layout import EnsembleLayout
from meshkit.ensemble._metrics import flatten_member_metrics
from meshkit.ensemble._state import num_members_of
from meshkit.ensemble._strategy import MemberStrategy, map_members, resolve_strategy
from meshkit.train import LossOutput, TrainState, apply_model
from meshkit.train.parts import Gradients, apply_update, gradients


class MemberOutput(NamedTuple):
    """What a member's loss function returns beside the loss, logits included.

    Attributes:
      collections: updated mutable collections (``{"batch_stats": ...}``), or ``{}``.
      metrics: extra scalar metrics of this member (``{"accuracy": ...}``).
      logits: the member's logits on its rows of the batch; with them (and a
        ``label`` field in the batch) the step also reports the ensemble's loss and
        accuracy on the training batch, from the averaged probabilities.
    """

    collections: Mapping[str, Any]
    metrics: Mapping[str, jax.Array]
    logits: jax.Array | None = None


MemberLossFn = Callable[
    [Any, TrainState, Batch, jax.Array], tuple[jax.Array, LossOutput | MemberOutput]
]
"""``loss_fn(params, member_state, batch, rng) -> (loss, MemberOutput | LossOutput)``.

The same contract as ``meshkit.train.LossFn``, called once per member with that
member's (un-stacked) train state and its rows of the batch; any ``meshkit.train``
loss function works. Returning ``MemberOutput`` with logits adds ensemble metrics.
"""


def classification_loss(
    params: Any, state: TrainState, batch: Batch, rng: jax.Array
) -> tuple[jax.Array, MemberOutput]:
    """One member's softmax cross-entropy on ``batch["image"]`` / ``batch["label"]``.

    Like ``meshkit.train.classification_loss`` (the model applied by
    ``meshkit.train.apply_model`` in training mode: dropout on, batch statistics
    updated), and also returns the logits, so the ensemble step can average the
    members' probabilities.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import train
        >>> model = train.linen_model(nn.Dense(10), jnp.zeros((1, 4)))
        >>> state = train.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=-1"))
        >>> batch = {"image": jnp.ones((8, 4)), "label": jnp.zeros(8, jnp.int32)}
        >>> loss, out = classification_loss(state.params, state, batch, jax.random.key(1))
        >>> out.logits.shape, sorted(out.metrics)
        ((8, 10), ['accuracy'])
    """
    logits, collections = apply_model(state, batch["image"], params=params, rng=rng)
    labels = batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, MemberOutput(collections, {"accuracy": accuracy}, logits)


def _pmean_floats(tree: Any, axis: str) -> Any:
    """``pmean`` of every floating-point leaf, as one collective (integers are kept)."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    means = jax.lax.pmean(tuple(leaves[i] for i in floats), axis)
    for i, mean in zip(floats, means, strict=True):
        leaves[i] = mean
    return jax.tree.unflatten(treedef, leaves)


def _member_gradients(
    loss_fn: MemberLossFn,
    member: TrainState,
    batch: Batch,
    layout: EnsembleLayout,
    microbatches: int,
) -> Gradients:
    """One member's loss and gradients on this device's rows (not yet averaged)."""
    rng = member.step_rng()
    if layout.batch_axis is not None:
        if layout.data_size > 1:  # each row block draws its own dropout masks
            rng = jax.random.fold_in(rng, jax.lax.axis_index(layout.batch_axis))
        # Differentiate per-device copies: their gradient is this device's own, which
        # the caller averages with pmean (the gradient of the replicated params would
        # come back already summed over the data axis); the collections, updated from
        # this device's rows, are per-device too until that pmean.
        varying = jax.lax.pcast(
            (member.params, member.collections), layout.batch_axis, to="varying"
        )
        member = member.replace(params=varying[0], collections=varying[1])
    return gradients(loss_fn, member, batch, rng, microbatches=microbatches)


def _local_member_columns(metrics_M: Metrics, layout: EnsembleLayout) -> Metrics:
    """This device's members' metrics, ``[K]`` each, in their columns (zeros elsewhere).

    One ``psum`` over the ensemble axis then assembles every member's values on every
    device.
    """
    first = jax.lax.axis_index(layout.ensemble_axis) * layout.members_per_device

    def in_member_columns(values_M: jax.Array) -> jax.Array:
        zeros_K = jnp.zeros(layout.num_members, jnp.float32)
        return jax.lax.dynamic_update_slice(zeros_K, values_M.astype(jnp.float32), (first,))

    return {name: in_member_columns(values) for name, values in metrics_M.items()}


def _ensemble_metrics(probs: jax.Array, labels: jax.Array, layout: EnsembleLayout) -> Metrics:
    """The ensemble's loss and accuracy on the batch, from the averaged member probabilities."""
    chosen = jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
    loss = -jnp.log(jnp.maximum(chosen, jnp.finfo(probs.dtype).tiny)).mean()
    accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
    metrics = {"ensemble_loss": loss, "ensemble_accuracy": accuracy}
    return metrics if layout.batch_axis is None else _pmean_floats(metrics, layout.batch_axis)


def _body(
    loss_fn: MemberLossFn,
    layout: EnsembleLayout,
    member_batches: bool,
    strategy: Literal["vmap", "loop"],
    microbatches: int,
    *,
    members_may_diverge: bool = False,
) -> Callable[..., tuple[TrainState, Metrics, Metrics]]:
    """The per-device step: ``(members, batch) -> (members, [K] metrics, ensemble metrics)``.

    Each member's gradients come from the train step's own core (``gradients``, with
    its loss scale and micro-batches), run as ``strategy`` says (``map_members``), and
    its update from ``apply_update`` (the float16 overflow skip included) mapped over
    the device's members. Collectives: one ``pmean`` over the data axis (every
    member's gradients, metrics and batch statistics together), one ``psum`` over the
    ensemble axis (metrics and probabilities together) and, with D > 1, one ``pmean``
    of the ensemble metrics. With ``members_may_diverge``, a member whose loss is not
    finite gets non-finite gradients, so a sweep's optimizer (which freezes a member on
    non-finite gradients) freezes it even when its loss went NaN on its own.
    """
    member_axis_of_batch = 1 if member_batches else None  # [rows, members, ...] or shared

    def member_step(member: TrainState, batch: Batch) -> Gradients:
        return _member_gradients(loss_fn, member, batch, layout, microbatches)

    def body(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics, Metrics]:
        grads_M = map_members(
            member_step,
            strategy,
            layout.members_per_device,
            state,
            dict(batch),
            in_axes=(0, member_axis_of_batch),
        )
        logits_MxBxC = getattr(grads_M.output, "logits", None)
        if logits_MxBxC is not None:  # per row: not averaged over the data axis
            grads_M = grads_M._replace(output=grads_M.output._replace(logits=None))
        if layout.batch_axis is not None:
            grads_M = _pmean_floats(grads_M, layout.batch_axis)
        if members_may_diverge:
            grads_M = _mark_non_finite_losses(grads_M)
        state, metrics_M = jax.vmap(apply_update)(state, grads_M)
        if member_batches or "label" not in batch:
            logits_MxBxC = None  # members on different rows: no ensemble prediction
        probs_sum = 0 if logits_MxBxC is None else jax.nn.softmax(logits_MxBxC).sum(0)
        metrics_K, probs_sum = jax.lax.psum(
            (_local_member_columns(metrics_M, layout), jnp.asarray(probs_sum)),
            layout.ensemble_axis,
        )
        ensemble_metrics: Metrics = {}
        if logits_MxBxC is not None:
            probs = probs_sum / layout.num_members
            ensemble_metrics = _ensemble_metrics(probs, batch["label"], layout)
        return state, metrics_K, ensemble_metrics

    return body


def _mark_non_finite_losses(grads_M: Gradients) -> Gradients:
    """Each member's gradients, NaN where its loss is not finite (``[M]`` members)."""
    bad_M = ~jnp.isfinite(grads_M.loss)

    def marked(grad: jax.Array) -> jax.Array:
        return jnp.where(bad_M.reshape(bad_M.shape + (1,) * (grad.ndim - 1)), jnp.nan, grad)

    return grads_M._replace(grads=jax.tree.map(marked, grads_M.grads))


def _metrics(
    metrics_K: Metrics, ensemble_metrics: Metrics, member_metrics: bool, members_may_diverge: bool
) -> Metrics:
    """The step's scalars, from every member's metrics.

    ``loss`` is the members' mean, ``grad_norm`` the norm of all members' gradients
    together, and with float16 ``skipped`` the fraction of members whose step was skipped.
    With ``members_may_diverge`` (a sweep, whose optimizer freezes a member whose
    gradients stop being finite) ``loss`` and ``grad_norm`` are over the members whose
    values are finite, so ``fit`` stops only when none is, and ``diverged`` counts the
    others.
    """
    loss_K, grad_norm_K = metrics_K["loss"], metrics_K["grad_norm"]
    if members_may_diverge:
        finite_K = jnp.isfinite(loss_K) & jnp.isfinite(grad_norm_K)
        count = jnp.sum(finite_K)
        loss = jnp.where(count > 0, jnp.sum(jnp.where(finite_K, loss_K, 0.0)) / count, jnp.nan)
        squares = jnp.sum(jnp.where(finite_K, grad_norm_K, 0.0) ** 2)
        metrics = {
            "loss": loss,
            "grad_norm": jnp.where(count > 0, jnp.sqrt(squares), jnp.nan),
            "diverged": jnp.sum(~finite_K).astype(jnp.float32),
            **ensemble_metrics,
        }
    else:
        metrics = {
            "loss": loss_K.mean(),
            "grad_norm": jnp.sqrt(jnp.sum(grad_norm_K**2)),
            **ensemble_metrics,
        }
    if "skipped" in metrics_K:
        metrics["skipped"] = metrics_K["skipped"].mean()
    if not member_metrics:
        return metrics
    return {**metrics, **flatten_member_metrics(metrics_K)}


def _check_inputs(
    state: TrainState, batch: Batch, layout: EnsembleLayout, member_batches: bool, microbatches: int
) -> None:
    """Trace-time checks (shapes are static), before shard_map reports them less clearly."""
    num_members = num_members_of(state)
    if num_members != layout.num_members:
        raise ValueError(
            f"The state holds {num_members} members but the step was built for "
            f"{layout.num_members} ({layout!r}). Build the step and the state from the "
            "same EnsembleLayout."
        )
    for key, value in batch.items():
        shape = tuple(value.shape)
        if not shape or shape[0] % (layout.data_size * microbatches):
            split = "" if microbatches == 1 else f" times microbatches={microbatches}"
            raise ValueError(
                f"Batch field {key!r} has shape {shape}: its rows must be a multiple of the "
                f"{layout.data_size} devices of the {layout.data_axis!r} axis{split} "
                f"({layout!r}). Change the batch size"
                + ("." if microbatches == 1 else " or the number of micro-batches.")
            )
        if member_batches and (len(shape) < 2 or shape[1] != layout.num_members):
            raise ValueError(
                f"member_batches=True expects every batch field shaped [rows, "
                f"{layout.num_members} members, ...] (from MemberTrainPipeline), but "
                f"{key!r} has shape {shape}. Feed a MemberTrainPipeline, or build the step "
                "with member_batches=False for one batch shared by all members."
            )


def make_ensemble_step(
    loss_fn: MemberLossFn,
    layout: EnsembleLayout,
    *,
    member_batches: bool = False,
    member_metrics: bool = True,
    donate: bool = True,
    strategy: MemberStrategy = "auto",
    microbatches: int = 1,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """A jitted ``step(state, batch) -> (state, metrics)`` training all K members at once.

    Shardings are stated at the jit boundary: the ensemble state (from
    ``create_ensemble_state``) keeps ``P('ensemble')`` on its member axis, the batch
    arrives split over ``data`` and replicated over ``ensemble``, and the metrics come
    back replicated. The input state is donated by default. Inside, a ``shard_map`` runs
    each device's members (batched or one after the other: ``strategy``) on its rows of
    the batch; each member's gradient is averaged over the data axis (``pmean``) and its
    optimizer update applied. Members never mix: a member's parameters only ever see
    its own gradient. The gradients and the update are the data-parallel train step's
    own (``meshkit.train.parts.gradients`` and ``meshkit.train.parts.apply_update``), so
    micro-batches and float16 loss scaling work here as they do there: with
    ``create_ensemble_state(..., precision="f16")`` every member has its own loss
    scale, and a member whose gradients overflow skips its update while the others
    apply theirs.

    Batch statistics (``batch_stats``) are computed per device over its rows, like a
    ``pmap``'d BatchNorm without ``axis_name``, and the updated running averages are
    averaged over the data axis, so all devices keep the same values. Dropout masks
    come from each member's own key, folded with the step and, when D > 1, the row
    block.

    Metrics, all scalars (``meshkit.train.fit`` logs and checks them):

    - ``loss``: the mean of the members' losses (what is minimised); ``grad_norm``:
      the global norm of all members' gradients;
    - ``member_<i>/loss``, ``member_<i>/grad_norm`` and ``member_<i>/<metric>`` for
      every metric of ``loss_fn`` (read them back with ``per_member``);
    - with float16, ``member_<i>/skipped`` and ``member_<i>/loss_scale``, and
      ``skipped``: the fraction of members whose step was skipped;
    - ``ensemble_loss`` and ``ensemble_accuracy`` of the averaged member probabilities
      on the training batch, when ``loss_fn`` returns ``MemberOutput`` logits and the
      members share the batch.

    Args:
      loss_fn: a member's loss, e.g. ``meshkit.ensemble.classification_loss``; any
        ``meshkit.train`` loss function works too (no ensemble metrics then).
      layout: the ``EnsembleLayout`` the state was built with.
      member_batches: ``False`` (default): every member sees the same batch, as in
        the Flax ensembling HOWTO's ``pmap`` program. ``True``: batches from
        ``MemberTrainPipeline``, whose fields are ``[rows, K, ...]``, give each member
        its own data order.
      member_metrics: report the ``member_<i>/...`` scalars (default). Each is one
        more output of the step; ``meshkit.train.fit`` sums them on the device with
        the rest, but a loop of your own that reads them pays per scalar. ``False``
        keeps only the ensemble-wide metrics.
      donate: donate the input state, so the new state reuses its buffers (the
        default, as ``meshkit.train.make_train_step``; rebind ``state`` after every
        call). ``False`` keeps two copies of the state alive during a step but lets
        XLA's CPU backend skip the copy of every parameter it inserts before updating
        a donated buffer in place (measured in the ensembles guide).
      strategy: how each device runs its members: ``"vmap"`` (batched, one program;
        fast on GPUs and TPUs), ``"loop"`` (one after the other as plain networks;
        fast on CPUs) or ``"auto"`` (the default: by the devices' platform). Both
        train the same members, to float rounding (tested against each other).
      microbatches: split the batch into this many micro-batches whose gradients are
        accumulated before each member's one update, as ``meshkit.train.make_train_step``
        does; the global batch size must be a multiple of ``microbatches`` times the
        devices of the data axis.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 2)
        >>> model = train.linen_model(nn.Dense(10), jnp.zeros((1, 4)))
        >>> state = ensemble.create_ensemble_state(model, optax.sgd(0.1), layout)
        >>> step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
        >>> batch = meshkit.shard_batch({"image": np.ones((8, 4), np.float32),
        ...                              "label": np.arange(8, dtype=np.int32)},
        ...                             layout.batch_sharding)
        >>> state, metrics = step(state, batch)
        >>> meshkit.to_host(state.step).tolist(), sorted(metrics)[:4]
        ([1, 1], ['ensemble_accuracy', 'ensemble_loss', 'grad_norm', 'loss'])
        >>> ensemble.per_member(meshkit.to_host(metrics), "accuracy").shape
        (2,)
    """
    return ensemble_step(
        loss_fn,
        layout,
        member_batches=member_batches,
        member_metrics=member_metrics,
        donate=donate,
        strategy=strategy,
        microbatches=microbatches,
        members_may_diverge=False,
    )


def ensemble_step(
    loss_fn: MemberLossFn,
    layout: EnsembleLayout,
    *,
    member_batches: bool,
    member_metrics: bool,
    donate: bool,
    strategy: MemberStrategy,
    microbatches: int,
    members_may_diverge: bool,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``make_ensemble_step``, and for sweeps ``members_may_diverge`` (see ``_metrics``)."""
    resolved = resolve_strategy(strategy, layout)
    check_int(microbatches, name="microbatches", minimum=1)
    batch_spec = layout.batch_spec
    if member_batches:
        batch_spec = PartitionSpec(layout.batch_axis, layout.ensemble_axis)
    mapped = jax.shard_map(
        _body(
            loss_fn,
            layout,
            member_batches,
            resolved,
            microbatches,
            members_may_diverge=members_may_diverge,
        ),
        mesh=layout.mesh,
        in_specs=(layout.member_spec, batch_spec),
        out_specs=(layout.member_spec, PartitionSpec(), PartitionSpec()),
    )

    def ensemble_train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        _check_inputs(state, batch, layout, member_batches, microbatches)
        state, metrics_K, ensemble_metrics = mapped(state, dict(batch))
        return state, _metrics(metrics_K, ensemble_metrics, member_metrics, members_may_diverge)

    replicated = replicated_sharding(layout.mesh)
    return jax.jit(
        ensemble_train_step,
        in_shardings=(layout.state_sharding, layout.batch_sharding),
        out_shardings=(layout.state_sharding, replicated),
        donate_argnums=0 if donate else (),
    )
