"""The Flax ensembling HOWTO: its pmap program vs meshkit.ensemble on several meshes.

    python -m benchmarks.ensemble                  # or: python -m benchmarks ensemble
    python -m benchmarks.ensemble --alternatives   # also the layouts meshkit rejected

On 8 fake CPU devices, every candidate trains an ensemble of the HOWTO's MNIST CNN (SGD,
learning rate 0.1, momentum 0.9) on the same host batch of 32 images of 28×28×1 (the
HOWTO's batch size). A call runs 4 steps as a training loop should: step k is
dispatched, then step k-1's ensemble accuracy is read, so one step is in flight and
the host's work overlaps the devices'; the call ends when the last step's state is
ready. Calls are interleaved A B C ... with a rotating order, and times are per step:

- the HOWTO's program (8 members, one per device), ported with the smallest change:
  pmap stays pmap, ``flax.jax_utils.replicate`` and ``unreplicate`` stay;
- meshkit with K=8 on ``ensemble=8`` (the HOWTO's layout), K=16 on ``ensemble=8`` (two
  members per device), K=8 on ``ensemble=8`` without donating the state (the HOWTO does
  not donate; on XLA's CPU backend a donated state costs a copy of each parameter), and
  K=8 on ``ensemble=4,data=2`` and ``ensemble=2,data=4`` (each member's batch split over
  2 or 4 devices).

Reported: medians and totals, ratios of totals against the HOWTO's program, the time
per member-step of K=16 against K=8, every compilation, and the compilations of a
whole ``fit`` run. ``--alternatives`` times the layouts meshkit rejected (``vmap``
over members under jit, ``lax.map`` and ``vmap`` over a device's members inside
``shard_map``) against meshkit's, with fewer rounds: they are slow.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable
from typing import Any

import meshkit
from recipes._args import positive_int

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks._harness import interleave, report, save, stopped_by_a_signal  # noqa: E402
from benchmarks.quoted import markdown_table  # noqa: E402
from meshkit import data, ensemble, train  # noqa: E402
from meshkit.models import MnistCNN  # noqa: E402

CNN = MnistCNN  # the HOWTO's CNN, as written in the HOWTO
learning_rate = 0.1
momentum = 0.9
batch_size = 32
STEPS_PER_CALL = 4
ROUNDS = 20
ALTERNATIVE_ROUNDS = 3


# The HOWTO's program. ------------------------------------------------------------


@functools.partial(jax.pmap, static_broadcasted_argnums=(1, 2))
def create_train_state(rng, learning_rate, momentum):
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 28, 28, 1]))["params"]
    tx = optax.sgd(learning_rate, momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


@functools.partial(jax.pmap, axis_name="ensemble")
def apply_model(state, images, labels):
    def loss_fn(params):
        logits = CNN().apply({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()  # pyright: ignore[reportArgumentType]
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    probs = jax.lax.pmean(jax.nn.softmax(logits), axis_name="ensemble")
    accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
    return grads, loss, accuracy


@jax.pmap
def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def seed_candidate(images: np.ndarray, labels: np.ndarray):
    """One step of the HOWTO's ``train_epoch`` loop body, blocking on the accuracy."""
    rng = jax.random.PRNGKey(0)
    rng, init_rng = jax.random.split(rng)
    state = create_train_state(
        jax.random.split(init_rng, jax.device_count()), learning_rate, momentum
    )

    def run() -> None:
        nonlocal state
        pending = None
        for _ in range(STEPS_PER_CALL):
            batch_images = jax_utils.replicate(images)
            batch_labels = jax_utils.replicate(labels)
            grads, loss, accuracy = apply_model(state, batch_images, batch_labels)
            state = update_model(state, grads)
            jax_utils.unreplicate(loss)
            if pending is not None:
                float(pending)  # the previous step's accuracy: one step in flight
            pending = jax_utils.unreplicate(accuracy)
        jax.block_until_ready((state, pending))  # the last step, and its state

    return run


# meshkit. --------------------------------------------------------------------------


def model() -> train.Model:
    return train.linen_model(CNN(), jnp.zeros((1, 28, 28, 1)))


def meshkit_candidate(
    mesh_axes: str, members: int, images: np.ndarray, labels: np.ndarray, *, donate: bool = True
):
    layout = ensemble.EnsembleLayout(meshkit.make_mesh(mesh_axes), members)
    tx = optax.sgd(learning_rate, momentum)
    state = ensemble.create_ensemble_state(model(), tx, layout, seed=0)
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout, donate=donate)
    host_batch = {"image": images, "label": labels}

    def run() -> None:
        nonlocal state
        pending = None
        for _ in range(STEPS_PER_CALL):
            batch = meshkit.shard_batch(
                host_batch, layout.batch_sharding, global_batch_size=batch_size
            )
            state, metrics = step(state, batch)
            if pending is not None:
                float(pending)  # the previous step's accuracy: one step in flight
            pending = metrics["ensemble_accuracy"]
        jax.block_until_ready((state, pending))  # the last step, and its state

    return run


def whole_run_compiles() -> dict:
    """Compiles of the ensemble step over a ``fit`` run: an epoch of the digits at 28×28."""
    layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=-1"), 8)
    source = data.digits("train", image_size=28)
    pipeline = data.TrainPipeline(source, global_batch_size=128, sharding=layout.batch_sharding)
    evaluation = data.EvalPipeline(
        data.digits("test", image_size=28), global_batch_size=128, sharding=layout.batch_sharding
    )
    state = ensemble.create_ensemble_state(model(), optax.sgd(learning_rate, momentum), layout)
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    steps = pipeline.steps_per_epoch
    with tempfile.TemporaryDirectory() as workdir:
        result = train.fit(
            state,
            step,
            pipeline,
            num_steps=steps,
            workdir=workdir,
            evaluation=train.Evaluation(
                evaluation, per_example_fn=ensemble.ensemble_metrics(layout)
            ),
            checkpoints=train.Checkpoints(every=steps),
            logging=train.Logging(progress=False),
        )
        stopped_by_a_signal(result)
    return {
        "steps": steps,
        "global_batch_size": pipeline.global_batch_size,
        "train_step_compiles": result.train_step_compiles,
        "test_examples": result.eval_metrics["count"],
    }


# One device: the member strategies against a hand-written jit(vmap). ---------------


def one_device_candidate(
    kind: str, members: int, images: np.ndarray, labels: np.ndarray, steps: int
) -> tuple[Callable[[], None], float]:
    """``(run, compile_seconds)`` for ``steps`` queued steps on one device.

    ``kind``: ``"member"`` (one member alone: the plain step), ``"jit(vmap)"`` (what a
    user writes by hand), or a meshkit strategy, ``"loop"`` or ``"vmap"``.
    """
    mesh = meshkit.make_mesh("ensemble=1", devices=jax.devices()[:1])
    layout = ensemble.EnsembleLayout(mesh, members)
    tx = optax.sgd(learning_rate, momentum)
    state = ensemble.create_ensemble_state(model(), tx, layout, seed=0)
    replicated = NamedSharding(mesh, P())
    if kind in ("loop", "vmap"):
        step = ensemble.make_ensemble_step(ensemble.classification_loss, layout, strategy=kind)
    else:
        if kind == "member":
            state = ensemble.member_state(state, 0)
            body = _member_step
        else:
            body = jax.vmap(_member_step, in_axes=(0, None))
        shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
        step = jax.jit(
            body,
            in_shardings=(shardings, replicated),
            out_shardings=(shardings, replicated),
            donate_argnums=0,
        )
    batch = jax.device_put({"image": images, "label": labels}, replicated)
    with meshkit.count_compiles() as log:
        state, _ = step(state, batch)
        jax.block_until_ready(state)
    compile_seconds = log.seconds()

    def run() -> None:  # steps queued, as on an accelerator; one wait at the end
        nonlocal state
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)

    return run, compile_seconds


def one_device(images: np.ndarray, labels: np.ndarray, rounds: int) -> dict:
    """K members on one device: meshkit's two strategies, jit(vmap), one member alone."""
    on_cpu = jax.devices()[0].platform == "cpu"
    steps = 2 if on_cpu else 200
    results = {}
    for members in (8, 32):
        kinds = ["member", "jit(vmap)", "loop", "vmap"] if members == 8 else ["loop", "vmap"]
        built = {kind: one_device_candidate(kind, members, images, labels, steps) for kind in kinds}
        names = {
            kind: f"K={members} {kind}" if kind != "member" else "one member" for kind in kinds
        }
        timings = interleave(
            {names[kind]: run for kind, (run, _) in built.items()},
            rounds=rounds if members == 8 else 1,
            warmup=1,
        )
        for timing in timings.values():
            timing.seconds = [seconds / steps for seconds in timing.seconds]
        baseline = names["jit(vmap)"] if members == 8 else names["loop"]
        table = report(
            f"K={members} members of the HOWTO's CNN on one device, batch {batch_size}, "
            f"{steps} steps queued per call",
            timings,
            baseline=baseline,
        )
        table["compile_seconds"] = {names[kind]: seconds for kind, (_, seconds) in built.items()}
        print(
            "compile seconds: "
            + ", ".join(f"{k} {v:.1f}" for k, v in table["compile_seconds"].items())
        )
        results[f"K={members}"] = table
    return results


# Layouts meshkit measured and rejected. ---------------------------------------------


def _member_step(member: train.TrainState, batch: dict) -> tuple[train.TrainState, jax.Array]:
    grads, out = jax.grad(ensemble.classification_loss, has_aux=True)(
        member.params, member, batch, jax.random.key(0)
    )
    assert out.logits is not None
    return member.apply_gradients(grads), jax.nn.softmax(out.logits)


def alternative_candidate(kind: str, members: int, images: np.ndarray, labels: np.ndarray):
    """Other ways to write the same step (one batch shared by all members, no data axis)."""
    layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=-1"), members)
    state = ensemble.create_ensemble_state(model(), optax.sgd(learning_rate, momentum), layout)
    replicated = NamedSharding(layout.mesh, P())

    def over_members(state, batch):
        if kind == "lax.map":
            return jax.lax.map(lambda member: _member_step(member, batch), state)
        return jax.vmap(_member_step, in_axes=(0, None))(state, batch)

    def local(state, batch):
        state, probs = over_members(state, batch)
        probs = jax.lax.psum(probs.sum(0), "ensemble") / members
        return state, jnp.mean(jnp.argmax(probs, -1) == batch["label"])

    def global_vmap(state, batch):
        state, probs = over_members(state, batch)
        return state, jnp.mean(jnp.argmax(probs.mean(0), -1) == batch["label"])

    body = global_vmap
    if kind != "jit(vmap)":
        body = jax.shard_map(
            local, mesh=layout.mesh, in_specs=(P("ensemble"), P()), out_specs=(P("ensemble"), P())
        )
    step = jax.jit(
        body,
        in_shardings=(layout.state_sharding, replicated),
        out_shardings=(layout.state_sharding, replicated),
        donate_argnums=0,
    )
    host_batch = {"image": images, "label": labels}

    def run() -> None:  # as the other candidates: steps with one in flight
        nonlocal state
        pending = None
        for _ in range(STEPS_PER_CALL):
            state, accuracy = step(state, jax.device_put(host_batch, replicated))
            if pending is not None:
                float(pending)
            pending = accuracy
        jax.block_until_ready((state, pending))  # the last step, and its state

    return run


def alternatives(images: np.ndarray, labels: np.ndarray) -> dict:
    candidates = {
        "meshkit K=8 (unrolled)": meshkit_candidate("ensemble=8", 8, images, labels),
        "meshkit K=16 (unrolled, 2/device)": meshkit_candidate("ensemble=8", 16, images, labels),
        "jit(vmap) K=8": alternative_candidate("jit(vmap)", 8, images, labels),
        "shard_map + lax.map K=8": alternative_candidate("lax.map", 8, images, labels),
        "shard_map + vmap K=16 (2/device)": alternative_candidate("vmap", 16, images, labels),
    }
    timings = interleave(candidates, rounds=ALTERNATIVE_ROUNDS, warmup=1)
    for timing in timings.values():
        timing.seconds = [seconds / STEPS_PER_CALL for seconds in timing.seconds]
    return report(
        f"ensemble layouts, K members of the HOWTO's CNN, batch {batch_size}, "
        f"{ALTERNATIVE_ROUNDS} rounds interleaved",
        timings,
        baseline="meshkit K=8 (unrolled)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--alternatives", action="store_true")
    parser.add_argument("--rounds", type=positive_int, default=ROUNDS)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch_size, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=batch_size).astype(np.int32)
    n = jax.device_count()
    on_cpu = jax.devices()[0].platform == "cpu"
    one = one_device(images, labels, rounds=3 if on_cpu else 5)
    if n < 8:  # the HOWTO's program needs one device per member
        save("ensemble", {"one_device": one}, tables)
        return

    candidates = {
        "HOWTO pmap, K=8": seed_candidate(images, labels),
        "meshkit K=8, ensemble=8": meshkit_candidate("ensemble=8", 8, images, labels),
        "meshkit K=16, ensemble=8": meshkit_candidate("ensemble=8", 16, images, labels),
        "meshkit K=8, ensemble=8, donate=False": meshkit_candidate(
            "ensemble=8", 8, images, labels, donate=False
        ),
        "meshkit K=8, ensemble=4,data=2": meshkit_candidate("ensemble=4,data=2", 8, images, labels),
        "meshkit K=8, ensemble=2,data=4": meshkit_candidate("ensemble=2,data=4", 8, images, labels),
    }
    timings = interleave(candidates, rounds=args.rounds)
    for timing in timings.values():  # seconds per call -> seconds per step
        timing.seconds = [seconds / STEPS_PER_CALL for seconds in timing.seconds]
    result = report(
        f"ensemble step, the Flax ensembling HOWTO's MNIST CNN, batch {batch_size}, {n} devices, "
        f"{args.rounds} rounds of {STEPS_PER_CALL} steps interleaved",
        timings,
        baseline="HOWTO pmap, K=8",
    )
    seed, k8, k16, k8_kept = (timings[name] for name in list(candidates)[:4])
    result["median_ratio_meshkit_k8_over_pmap"] = k8.median / seed.median
    result["total_ratio_meshkit_k8_over_pmap"] = k8.total / seed.total
    result["median_ratio_meshkit_k8_no_donation_over_pmap"] = k8_kept.median / seed.median
    result["total_ratio_meshkit_k8_no_donation_over_pmap"] = k8_kept.total / seed.total
    result["median_per_member_ratio_k16_over_k8"] = (k16.median / 16) / (k8.median / 8)
    result["total_per_member_ratio_k16_over_k8"] = (k16.total / 16) / (k8.total / 8)
    result["whole_run"] = whole_run_compiles()
    print(
        f"\nmedian step time meshkit K=8 / pmap: {result['median_ratio_meshkit_k8_over_pmap']:.3f}"
        f" (ratio of totals {result['total_ratio_meshkit_k8_over_pmap']:.3f}); without donation "
        f"{result['median_ratio_meshkit_k8_no_donation_over_pmap']:.3f} "
        f"({result['total_ratio_meshkit_k8_no_donation_over_pmap']:.3f})"
        f"\ntime per member-step K=16 / K=8: median "
        f"{result['median_per_member_ratio_k16_over_k8']:.3f}, ratio of totals "
        f"{result['total_per_member_ratio_k16_over_k8']:.3f}"
        f"\nwhole fit run ({result['whole_run']['steps']} steps + full eval): "
        f"{result['whole_run']['train_step_compiles']} compile(s) of the ensemble step"
    )
    if args.alternatives:
        result["alternatives"] = alternatives(images, labels)
    save("ensemble", {**result, "one_device": one}, tables)


LABELS = {
    "HOWTO pmap, K=8": "the HOWTO's `pmap` program, K=8",
    "meshkit K=8, ensemble=8": "meshkit K=8, `ensemble=8`",
    "meshkit K=16, ensemble=8": "meshkit K=16, `ensemble=8` (2 members per device)",
    "meshkit K=8, ensemble=8, donate=False": "meshkit K=8, `ensemble=8`, state not donated",
    "meshkit K=8, ensemble=4,data=2": "meshkit K=8, `ensemble=4,data=2`",
    "meshkit K=8, ensemble=2,data=4": "meshkit K=8, `ensemble=2,data=4`",
}
STRATEGY_LABELS = (
    ("K=8", "one member", "one member alone"),
    ("K=8", "K=8 jit(vmap)", "K=8, hand-written `jit(vmap)`"),
    ("K=8", "K=8 loop", 'K=8, meshkit `strategy="loop"` (the CPU default)'),
    ("K=8", "K=8 vmap", 'K=8, meshkit `strategy="vmap"`'),
    ("K=32", "K=32 loop", 'K=32, meshkit `"loop"`'),
    ("K=32", "K=32 vmap", 'K=32, meshkit `"vmap"`'),
)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``strategies``: K members on one device with each member strategy (per step, per
    member-step, against a hand-written ``jit(vmap)`` from totals at K=8, compile
    seconds); with 8 devices also ``table``, the ensemble step against the HOWTO's pmap
    program, and ``ratios``, what the table's rows give."""
    strategies = []
    for group, name, label in STRATEGY_LABELS:
        measured = run["one_device"][group]
        row = measured["candidates"][name]
        members = 1 if name == "one member" else int(group.removeprefix("K="))
        strategies.append(
            [
                label,
                f"{row['median_s'] * 1e3:,.1f}",
                f"{row['median_s'] / members * 1e3:,.1f}",
                f"{row['ratio_of_totals_vs_baseline']:.2f}" if group == "K=8" else "",
                f"{measured['compile_seconds'][name]:.1f}",
            ]
        )
    header = ["candidate", "median ms/step", "ms per member-step", "vs `jit(vmap)` (totals)"]
    made = {"strategies": markdown_table([*header, "compile s"], strategies)}
    if "candidates" not in run:
        return made
    rows = [
        [
            label,
            f"{c['median_s'] * 1000.0:.1f}",
            f"{c['total_s']:.3f}",
            f"{c['ratio_of_totals_vs_baseline']:.3f}",
            str(c["compiles"]),
        ]
        for name, label in LABELS.items()
        for c in [run["candidates"][name]]
    ]
    header = ["candidate", "median ms/step", "total s", "total / pmap", "compiles"]
    made["table"] = markdown_table(header, rows)
    whole = run["whole_run"]
    ratios = [
        [
            "meshkit K=8 / pmap, time per step",
            f"{run['median_ratio_meshkit_k8_over_pmap']:.3f}",
            f"{run['total_ratio_meshkit_k8_over_pmap']:.3f}",
        ],
        [
            "K=16 / K=8, time per member-step",
            f"{run['median_per_member_ratio_k16_over_k8']:.3f}",
            f"{run['total_per_member_ratio_k16_over_k8']:.3f}",
        ],
    ]
    made["ratios"] = markdown_table(["", "of medians", "of totals"], ratios)
    made["whole_run"] = markdown_table(
        ["a whole `fit` run", "steps", "evaluated examples", "ensemble-step compiles"],
        [
            [
                "K=8",
                str(whole["steps"]),
                str(whole["test_examples"]),
                str(whole["train_step_compiles"]),
            ]
        ],
    )
    return made


if __name__ == "__main__":
    main()
