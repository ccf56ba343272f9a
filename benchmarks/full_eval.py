"""The cost of exactness: ``full_eval`` against an eval that drops the remainder.

    python -m benchmarks full_eval

On 8 fake CPU devices, for the 360 digits test images (global batch 64: 5 full
batches and 40 left over) and a synthetic set of 10,000 32×32×3 images (batch 256:
39 full batches and 16 left over), two candidates run interleaved:

- drop remainder: the full batches only, sharded, one jitted step per batch, the
  correct-count summed on the devices (what the Flax full-evaluation notebook warns
  against: it skips examples);
- full_eval: every example, the last batch padded and masked.

Reported: time per *real* example counted, and the ratio of totals.
"""

from __future__ import annotations

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks._harness import interleave, report, save  # noqa: E402
from meshkit import data, evaluate, train  # noqa: E402
from meshkit.models import CifarNet, NormCNN  # noqa: E402


def correct(state, batch):
    predictions = state.apply_fn(state.variables(), batch["image"]).argmax(-1)
    return {"correct": (predictions == batch["label"]).astype(jnp.float32)}


def case(name, module, arrays, batch_size, *, mesh, rounds):
    sample = jnp.zeros((1, *arrays["image"].shape[1:]))
    state = train.create_train_state(train.linen_model(module, sample), optax.sgd(0.1), mesh)
    sharding = meshkit.batch_sharding(mesh)
    n = len(arrays["label"])
    kept = n - n % batch_size

    @jax.jit
    def count_correct(state, batch, total):
        return total + correct(state, batch)["correct"].sum()

    def drop_remainder():
        total = jnp.zeros(())
        for start in range(0, kept, batch_size):
            rows = slice(start, start + batch_size)
            batch = meshkit.shard_batch({k: v[rows] for k, v in arrays.items()}, sharding)
            total = count_correct(state, batch, total)
            jax.block_until_ready(total)  # one step in flight, as full_eval
        return float(total)

    def exact():
        return evaluate.full_eval(correct, state, arrays, mesh=mesh, batch_size=batch_size).count

    timings = interleave({"drop remainder": drop_remainder, "full_eval": exact}, rounds=rounds)
    table = report(
        f"{name}: {n} examples, global batch {batch_size}, {jax.device_count()} devices",
        timings,
        baseline="drop remainder",
        unit="pass",
    )
    for candidate, examples in (("drop remainder", kept), ("full_eval", n)):
        row = table["candidates"][candidate]
        row["examples_counted"] = examples
        row["us_per_real_example"] = row["median_s"] / examples * 1e6
        print(
            f"  {candidate:<16} {examples:>6} examples  {row['us_per_real_example']:8.1f} µs each"
        )
    return table


def main() -> None:
    mesh = meshkit.make_mesh("data=-1")
    digits = data.digits("test").arrays
    rng = np.random.default_rng(0)
    synthetic = {
        "image": rng.random((10_000, 32, 32, 3), dtype=np.float32),
        "label": rng.integers(0, 10, 10_000).astype(np.int32),
    }
    results = {
        "digits": case("digits test split, NormCNN", NormCNN(), digits, 64, mesh=mesh, rounds=20),
        "synthetic": case(
            "synthetic 32x32x3, the cluster wiki's CIFAR net",
            CifarNet(),
            synthetic,
            256,
            mesh=mesh,
            rounds=4,
        ),
    }
    save("full_eval", results)


if __name__ == "__main__":
    main()
