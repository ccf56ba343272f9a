"""A pmap program in the style of Flax's ImageNet example (models.py and train.py).

The reference the pmap-migration tests compare meshkit against: the example's ResNet
(batch norm with ``axis_name="batch"``, or without it for per-device statistics), its
``TrainState`` subclass with ``batch_stats`` and ``dynamic_scale``, its ``train_step``
(``pmean`` of gradients, weight decay in the loss, Nesterov SGD on a schedule),
``sync_batch_stats`` and its checkpointing through ``flax.training.checkpoints``. Sizes
are small (8×8 images, two blocks of width 8); the code paths are the example's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import checkpoints, train_state
from flax.training import dynamic_scale as dynamic_scale_lib
from jax import lax

NUM_CLASSES = 4
IMAGE_SHAPE = (8, 8, 3)
WEIGHT_DECAY = 1e-4


class ResNetBlock(nn.Module):
    filters: int
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """The example's ResNet, two stages of one block each."""

    axis_name: str | None = "batch"
    stage_sizes: Sequence[int] = (1, 1)
    num_filters: int = 8

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, norm, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(NUM_CLASSES)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: dynamic_scale_lib.DynamicScale | None


learning_rate_fn = optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 40)


def make_tx() -> optax.GradientTransformation:
    return optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True)


def loss_of(logits: jax.Array, labels: jax.Array, params: Any) -> jax.Array:
    """The example's loss: cross-entropy plus an L2 penalty on weights (ndim > 1)."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + WEIGHT_DECAY * 0.5 * weight_l2


def create_state(model: ResNet, *, half_precision: bool = False, seed: int = 0) -> TrainState:
    variables = model.init(jax.random.key(seed), jnp.ones((1, *IMAGE_SHAPE)), train=False)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=make_tx(),
        batch_stats=variables["batch_stats"],
        dynamic_scale=dynamic_scale_lib.DynamicScale() if half_precision else None,
    )


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, Any]:
    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        return loss_of(logits, batch["label"], params), new_model_state

    dynamic_scale = state.dynamic_scale
    is_fin = None
    if dynamic_scale:
        grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
        dynamic_scale, is_fin, (loss, new_model_state), grads = grad_fn(state.params)
    else:
        (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = lax.pmean(grads, axis_name="batch")
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    if is_fin is not None:
        new_state = new_state.replace(
            opt_state=jax.tree.map(
                functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
            ),
            params=jax.tree.map(
                functools.partial(jnp.where, is_fin), new_state.params, state.params
            ),
            dynamic_scale=dynamic_scale,
        )
    return new_state, lax.pmean(loss, axis_name="batch")


p_train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0,))


@functools.partial(jax.pmap, axis_name="batch")
def p_eval_step(state: TrainState, batch: dict[str, jax.Array]) -> jax.Array:
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, batch["image"], train=False, mutable=False)
    return lax.psum(jnp.sum(jnp.argmax(logits, -1) == batch["label"]), axis_name="batch")


def sync_batch_stats(state: TrainState) -> TrainState:
    cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def shard(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``common_utils.shard``: (devices, per_device, ...)."""
    n = jax.local_device_count()
    return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)


def data(steps: int, batch_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Learnable batches: the class is the brightest of four image quadrants."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        labels = rng.integers(0, NUM_CLASSES, batch_size)
        images = rng.normal(size=(batch_size, *IMAGE_SHAPE)).astype(np.float32)
        for row, label in enumerate(labels):
            i, j = divmod(int(label), 2)
            images[row, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4] += 1.5
        batches.append({"image": images, "label": labels.astype(np.int32)})
    return batches


def train(
    state: TrainState, batches: list[dict[str, np.ndarray]]
) -> tuple[TrainState, list[float]]:
    """Trains a replicated ``state`` on ``batches``; returns it (replicated) and the losses."""
    losses = []
    for batch in batches:
        state, loss = p_train_step(state, shard(batch))
        losses.append(float(loss[0]))
    return state, losses


def accuracy(state: TrainState, batch: dict[str, np.ndarray]) -> float:
    correct = p_eval_step(state, shard(batch))
    return float(correct[0]) / len(batch["label"])


def save(state: TrainState, workdir: str, *, unreplicate: bool = True) -> None:
    """``save_checkpoint`` of the example: batch stats synced, the first replica, on host."""
    state = sync_batch_stats(state)
    state = jax.device_get(jax_utils.unreplicate(state) if unreplicate else state)
    checkpoints.save_checkpoint(workdir, state, int(jax.device_get(state.step).ravel()[0]))
