"""Seed 001's data-parallel CIFAR step: its pmap program vs meshkit's sharded jit.

    python -m benchmarks data_parallel_step        # or: nox -s bench

Both candidates take the same host batch (512 images of 32×32×3, the seed's default
batch size) and run one SGD step of the seed's LeNet-style net on 8 fake CPU devices,
blocking on the loss as the seed does when it prints it. The baseline is the seed's
``train_step`` ported with the smallest change (``jax.random.key``); pmap stays pmap.
"""

from __future__ import annotations

import functools

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks._harness import interleave, report, save  # noqa: E402

BATCH = 512
ROUNDS = 20


class Net(nn.Module):
    """The seed's CIFAR-10 net."""

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.relu(nn.Conv(6, (5, 5))(x)), (2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(16, (5, 5))(x)), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(120)(x))
        x = nn.relu(nn.Dense(84)(x))
        return nn.Dense(10)(x)


def loss_fn(params, apply_fn, inputs, targets):
    outputs = apply_fn({"params": params}, inputs)
    return jnp.mean(optax.softmax_cross_entropy(outputs, jax.nn.one_hot(targets, 10)))


@functools.partial(jax.pmap, axis_name="gpus")
def pmap_train_step(state, inputs, targets):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, inputs, targets)
    grads = jax.lax.pmean(grads, axis_name="gpus")
    loss = jax.lax.pmean(loss, axis_name="gpus")
    return state.apply_gradients(grads=grads), loss


def jit_train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(
        state.params, state.apply_fn, batch["image"], batch["label"]
    )
    return state.apply_gradients(grads=grads), loss


def main() -> None:
    model = Net()
    params = model.init(jax.random.key(42), jnp.ones([1, 32, 32, 3]))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    rng = np.random.default_rng(0)
    images = rng.normal(size=(BATCH, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=BATCH).astype(np.int32)
    n = jax.local_device_count()

    pmap_state = jax_utils.replicate(state)

    def run_pmap():
        nonlocal pmap_state
        inputs = images.reshape(n, BATCH // n, *images.shape[1:])
        targets = labels.reshape(n, BATCH // n)
        pmap_state, loss = pmap_train_step(pmap_state, inputs, targets)
        float(loss[0])

    mesh = meshkit.make_mesh("data=-1")
    batch_sharding = meshkit.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    jit_state = meshkit.replicate(state, mesh)
    state_sharding = jax.tree.map(lambda x: x.sharding, jit_state)
    step = jax.jit(
        jit_train_step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )

    def run_meshkit():
        nonlocal jit_state
        batch = meshkit.shard_batch(
            {"image": images, "label": labels}, batch_sharding, global_batch_size=BATCH
        )
        jit_state, loss = step(jit_state, batch)
        float(loss)

    candidates = {"seed 001 pmap + pmean": run_pmap, "meshkit jit + shard_batch": run_meshkit}
    timings = interleave(candidates, rounds=ROUNDS)
    result = report(
        f"data-parallel step, CIFAR net, batch {BATCH}, {n} devices, {ROUNDS} rounds A B A B",
        timings,
        baseline="seed 001 pmap + pmean",
    )
    save("data_parallel_step", result)


if __name__ == "__main__":
    main()
