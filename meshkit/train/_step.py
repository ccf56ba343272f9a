"""The jitted train step: shardings at the boundary, state donated, no pmean."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from meshkit._checks import check_int
from meshkit._host import replicated_sharding
from meshkit._pytree import path_str
from meshkit._types import Batch, Metrics
from meshkit.train._gradients import (
    LossFn,
    LossOutput,
    apply_update,
    gradients,
    ordered_gradients,
)
from meshkit.train._state import TrainState

Reduction = Literal["all_reduce", "ordered"]
"""How a train step sums the devices' gradients: the compiler's all-reduce (fastest),
or gathered and added in device order (the same bits on any process layout)."""

REDUCTIONS: tuple[str, ...] = get_args(Reduction)


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
    with state.logical_scope(), _unbound_axis_hint():
        out = state.apply_fn(
            {"params": policy.to_compute(params), **state.collections},
            policy.to_compute(inputs),
            train=training,
            rngs={"dropout": rng} if training else None,
            mutable=mutable,
        )
    outputs, collections = out if mutable else (out, {})
    return policy.to_output(outputs), dict(collections)


@contextlib.contextmanager
def _unbound_axis_hint() -> Iterator[None]:
    """Turns JAX's ``unbound axis name`` error from a pmap-era model into its fix."""
    try:
        yield
    except NameError as error:
        match = re.search(r"unbound axis name: (\S+)", str(error))
        if match is None:
            raise
        name = match.group(1).rstrip(".")
        raise NameError(
            f"The model calls a collective over the axis {name!r} (in a pmap program, e.g. "
            f"nn.BatchNorm(axis_name={name!r}) or lax.pmean(x, {name!r})), but a jitted step "
            "binds no axis names. Either drop the axis name from the model: under jit, "
            "batch statistics are computed over the whole global batch already, which is "
            f"what the pmap program's axis_name={name!r} gave; or keep the model as it is "
            f"and wrap it: meshkit.train.per_device(model, mesh, axis_name={name!r}) runs it "
            "once per device as pmap did (not for meshkit.ensemble, whose members already "
            "run per device: drop the axis name there). See 'Collectives and BatchNorm' in "
            "docs/pmap.md."
        ) from error


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
    loss = _cross_entropy(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, LossOutput(collections=collections, metrics={"accuracy": accuracy})


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy; NaN for a label outside ``[0, classes)``.

    optax reads label -1 as the last class; here a label that is no class gives a NaN
    loss, which ``fit`` stops on (naming labels among the causes) and evaluation
    counts (``nonfinite/loss``): an on-device flag that costs no host read.
    """
    valid = (labels >= 0) & (labels < logits.shape[-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.where(valid, loss, jnp.nan)


def classification_metrics(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    """Per-example cross-entropy and correctness, in inference mode (for evaluation)."""
    logits, _ = apply_model(state, batch["image"])
    labels = batch["label"]
    return {
        "loss": _cross_entropy(logits, labels),
        "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
    }


def train_step_fn(
    loss_fn: LossFn,
    *,
    microbatches: int = 1,
    batch_sharding: NamedSharding | None = None,
    unroll_microbatches: bool | None = None,
    reduction: Reduction = "all_reduce",
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
    _check_reduction(reduction, batch_sharding)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        with state.logical_scope():  # nn.with_logical_constraint resolves to the mesh
            return _train_step(state, batch)

    def _train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        compute = ordered_gradients if reduction == "ordered" else gradients
        grads = compute(
            loss_fn,
            state,
            batch,
            state.step_rng(),
            microbatches=microbatches,
            batch_sharding=batch_sharding,  # pyright: ignore[reportArgumentType]
            unroll=unroll_microbatches,
        )
        return apply_update(state, grads)

    return train_step


def make_train_step(
    loss_fn: LossFn,
    state_shardings: TrainState,
    batch_sharding: NamedSharding,
    *,
    microbatches: int = 1,
    reduction: Reduction = "all_reduce",
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

    ``reduction="ordered"`` sums the devices' gradients in a fixed order instead of an
    all-reduce: the same bits on 1 process × 8 devices as on 2 × 4, for replicated
    parameters, at the cost of gathering every device's gradient on every device.
    Batch statistics are then those of each device's rows, averaged, and each
    device's rows draw their own dropout key.

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
    if reduction == "ordered":
        _check_replicated_params(state_shardings)
    step = jax.jit(
        train_step_fn(
            loss_fn, microbatches=microbatches, batch_sharding=batch_sharding, reduction=reduction
        ),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    # fit reads it to check the batch size before anything compiles
    step.microbatches = microbatches  # pyright: ignore[reportAttributeAccessIssue]
    return step


def _check_reduction(reduction: object, batch_sharding: NamedSharding | None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {list(REDUCTIONS)}.")
    if reduction == "ordered" and batch_sharding is None:
        raise ValueError(
            'reduction="ordered" needs the batch sharding, to split the batch into one group '
            "of rows per data shard; pass batch_sharding=meshkit.batch_sharding(mesh)."
        )


def _check_replicated_params(state_shardings: TrainState) -> None:
    """The ordered reduction gathers whole gradients: it is for replicated parameters."""
    split = [
        path_str(path)
        for path, sharding in jax.tree_util.tree_leaves_with_path(state_shardings.params)
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated
    ]
    if split:
        raise ValueError(
            f'reduction="ordered" gathers every device\'s whole gradient, so it needs '
            f"replicated parameters; these are sharded: {split[:5]}"
            f"{' ...' if len(split) > 5 else ''}. Use the default reduction with FSDP or "
            "model-parallel rules."
        )
