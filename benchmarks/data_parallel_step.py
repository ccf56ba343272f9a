"""A cluster wiki's data-parallel CIFAR step: its pmap program vs meshkit's sharded jit.

    python -m benchmarks data_parallel_step        # or: nox -s bench

Four candidates take the same host batch (512 images of 32×32×3, the wiki's default
batch size) and run one SGD step of the wiki's net on 8 fake CPU devices, blocking on
the loss as the wiki's program does when it prints it, interleaved A B C D A B C D:

- the wiki's ``train_step``, ported with the smallest change; pmap stays pmap;
- a hand-written ``jax.jit`` step with the same shardings (no meshkit);
- meshkit's ``make_train_step`` (which also computes accuracy and the gradient norm);
- the same with ``reduction="ordered"`` (gradients gathered and added in device order).

Then a whole ``fit`` run counts the train step's compilations.
"""

from __future__ import annotations

import functools

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks._harness import fit_once, interleave, report, save  # noqa: E402
from meshkit import data, train  # noqa: E402
from meshkit.models import CifarNet  # noqa: E402

BATCH = 512
ROUNDS = 30


Net = CifarNet  # the wiki's net, as written on the wiki page


def loss_fn(params, apply_fn, inputs, targets):
    outputs = apply_fn({"params": params}, inputs)
    return jnp.mean(optax.softmax_cross_entropy(outputs, jax.nn.one_hot(targets, 10)))


@functools.partial(jax.pmap, axis_name="gpus")
def pmap_train_step(state, inputs, targets):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, inputs, targets)
    grads = jax.lax.pmean(grads, axis_name="gpus")
    loss = jax.lax.pmean(loss, axis_name="gpus")
    return state.apply_gradients(grads=grads), loss


def hand_written_step(state, batch):
    """What a user would write by hand: the same shardings, flax's TrainState, no meshkit."""
    loss, grads = jax.value_and_grad(loss_fn)(
        state.params, state.apply_fn, batch["image"], batch["label"]
    )
    return state.apply_gradients(grads=grads), loss


def whole_run_compiles(mesh) -> dict:
    """Compiles of meshkit's train step over a whole fit: 3 epochs of 1,437 digits at batch 512.

    1,437 is not a multiple of 512: the wiki's loop would end each epoch on a 413-image
    batch, which pmap cannot even split over 8 devices; meshkit drops the global remainder.
    """

    sharding = meshkit.batch_sharding(mesh)
    source = data.digits("train", image_size=32, channels=3)
    pipeline = data.TrainPipeline(source, global_batch_size=BATCH, sharding=sharding)
    model = train.linen_model(Net(), jnp.zeros((1, 32, 32, 3)))
    state = train.create_train_state(model, optax.sgd(0.1), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    steps = 3 * pipeline.steps_per_epoch
    result = fit_once(state, step, pipeline, steps=steps)
    return {
        "steps": steps,
        "epochs": 3,
        "train_step_compiles": result.train_step_compiles,
        "input_wait_fraction": result.input_wait_fraction,
    }


def main() -> None:
    model = Net()
    mesh = meshkit.make_mesh("data=-1")
    # meshkit's state first; every candidate starts from the same parameter values.
    mk_state = train.create_train_state(
        train.linen_model(model, jnp.ones([1, 32, 32, 3])), optax.sgd(0.1), mesh, seed=42
    )
    params = meshkit.to_host(mk_state.params)
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
        float(loss[0])  # the wiki's program prints the loss every step

    batch_sharding = meshkit.batch_sharding(mesh)
    host_batch = {"image": images, "label": labels}

    # Hand-written: flax TrainState replicated, jit with the same shardings.
    hand_state = meshkit.replicate(state, mesh)
    hand_shardings = jax.tree.map(lambda x: x.sharding, hand_state)
    hand_step = jax.jit(
        hand_written_step,
        in_shardings=(hand_shardings, batch_sharding),
        out_shardings=(hand_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )

    def run_hand_written():
        nonlocal hand_state
        batch = jax.device_put(host_batch, batch_sharding)
        hand_state, loss = hand_step(hand_state, batch)
        float(loss)

    # meshkit: create_train_state + make_train_step (loss, accuracy and gradient norm).
    mk_step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(mk_state), batch_sharding
    )

    def run_meshkit():
        nonlocal mk_state
        batch = meshkit.shard_batch(host_batch, batch_sharding, global_batch_size=BATCH)
        mk_state, metrics = mk_step(mk_state, batch)
        float(metrics["loss"])

    # The same step with the devices' gradients gathered and added in device order
    # (reduction="ordered": the same bits on any process layout), from the same state.
    ordered_state = train.create_train_state(
        train.linen_model(model, jnp.ones([1, 32, 32, 3])), optax.sgd(0.1), mesh, seed=42
    )
    ordered_step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(ordered_state),
        batch_sharding,
        reduction="ordered",
    )

    def run_ordered():
        nonlocal ordered_state
        batch = meshkit.shard_batch(host_batch, batch_sharding, global_batch_size=BATCH)
        ordered_state, metrics = ordered_step(ordered_state, batch)
        float(metrics["loss"])

    candidates = {
        "wiki pmap + pmean": run_pmap,
        "hand-written jax.jit": run_hand_written,
        "meshkit make_train_step": run_meshkit,
        "meshkit, reduction='ordered'": run_ordered,
    }
    timings = interleave(candidates, rounds=ROUNDS)
    result = report(
        f"data-parallel step, the cluster wiki's CIFAR net, batch {BATCH}, {n} devices, "
        f"{ROUNDS} rounds interleaved",
        timings,
        baseline="wiki pmap + pmean",
    )
    base, hand, mine, ordered = (timings[name] for name in candidates)
    result["ratio_of_totals_ordered_over_all_reduce"] = ordered.total / mine.total
    result["median_ratio_meshkit_over_pmap"] = mine.median / base.median
    result["median_ratio_meshkit_over_hand_written"] = mine.median / hand.median
    result["whole_run"] = whole_run_compiles(mesh)
    print(
        f"\nmedian step time meshkit / pmap: {result['median_ratio_meshkit_over_pmap']:.3f}"
        f"\nmedian step time meshkit / hand-written jit: "
        f"{result['median_ratio_meshkit_over_hand_written']:.3f}"
        f"\nordered reduction / all-reduce (ratio of totals): "
        f"{result['ratio_of_totals_ordered_over_all_reduce']:.3f}"
        f"\nwhole run ({result['whole_run']['epochs']} epochs of digits, "
        f"{result['whole_run']['steps']} steps): "
        f"{result['whole_run']['train_step_compiles']} compile(s) of the train step, "
        f"input wait {result['whole_run']['input_wait_fraction']:.1%} of the time"
    )
    save("data_parallel_step", result)


if __name__ == "__main__":
    main()
