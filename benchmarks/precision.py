"""Mixed precision and micro-batches: step time and the compiled step's memory.

    python -m benchmarks precision        # or: nox -s bench

The Flax ensembling HOWTO's MNIST CNN on 28×28 inputs, global batch 512, one SGD
step per call on every device, as ``make_train_step`` builds it. The candidates,
interleaved: float32, bfloat16 and float16 (loss scaling) compute, and float32 with
4 and 8 micro-batches, unrolled (CPU's default) and as one loop (GPU's and TPU's).
Beside the times, XLA's memory analysis of each compiled step: the temporary buffers
(activations and gradients in flight), which micro-batches shrink, and the argument
bytes (the state and the batch).

On CPU devices bfloat16 and float16 arithmetic is emulated, so they are slower there;
their speed is a GPU/TPU question. The memory numbers hold on any backend.
"""

from __future__ import annotations

from typing import Any

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks._harness import interleave, report, save  # noqa: E402
from benchmarks.quoted import markdown_table  # noqa: E402
from meshkit import train  # noqa: E402
from meshkit.models import MnistCNN  # noqa: E402

BATCH = 512
ROUNDS = 10
CANDIDATES = {
    "f32": ("f32", 1, False),
    "bf16": ("bf16", 1, False),
    "f16 + loss scaling": ("f16", 1, False),
    "f32, 4 micro-batches, unrolled": ("f32", 4, True),
    "f32, 4 micro-batches, one loop": ("f32", 4, False),
    "f32, 8 micro-batches, unrolled": ("f32", 8, True),
    "f32, 8 micro-batches, one loop": ("f32", 8, False),
}


def main() -> None:
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(MnistCNN(), jnp.zeros((1, 28, 28, 1)))
    rng = np.random.default_rng(0)
    batch = meshkit.shard_batch(
        {
            "image": rng.normal(size=(BATCH, 28, 28, 1)).astype(np.float32),
            "label": rng.integers(0, 10, size=BATCH).astype(np.int32),
        },
        sharding,
    )
    runs = {}
    memory = {}
    for name, (precision, microbatches, unroll) in CANDIDATES.items():
        state = train.create_train_state(model, optax.sgd(0.01), mesh, precision=precision)
        shardings = train.state_shardings_of(state)

        def step_fn(state, batch, microbatches=microbatches, unroll=unroll):
            grads = train.parts.gradients(
                train.classification_loss,
                state,
                batch,
                state.step_rng(),
                microbatches=microbatches,
                batch_sharding=sharding,
                unroll=unroll,
            )
            return train.parts.apply_update(state, grads)

        step = jax.jit(
            step_fn,
            in_shardings=(shardings, sharding),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )
        analysis = step.lower(state, batch).compile().memory_analysis()
        assert analysis is not None
        memory[name] = {
            "temp_bytes": int(analysis.temp_size_in_bytes),
            "argument_bytes": int(analysis.argument_size_in_bytes),
            "output_bytes": int(analysis.output_size_in_bytes),
        }
        holder = {"state": state}

        def run(step=step, holder=holder):
            holder["state"], metrics = step(holder["state"], batch)
            jax.block_until_ready(metrics)

        runs[name] = run

    timings = interleave(runs, rounds=ROUNDS)
    result = report(
        f"MNIST CNN step, batch {BATCH}, {jax.device_count()} devices, {ROUNDS} rounds interleaved",
        timings,
        baseline="f32",
    )
    base = memory["f32"]["temp_bytes"]
    print(f"\n{'candidate':<34} {'temp MiB':>9} {'temp/f32':>9} {'arguments MiB':>14}")
    for name, numbers in memory.items():
        print(
            f"{name:<34} {numbers['temp_bytes'] / 2**20:>9.2f} "
            f"{numbers['temp_bytes'] / base:>9.3f} {numbers['argument_bytes'] / 2**20:>14.2f}"
        )
    result["memory"] = memory
    save("precision", result, tables)


LABELS = {
    "f32": "f32",
    "bf16": "bf16",
    "f16 + loss scaling": "f16 + loss scaling",
    "f32, 4 micro-batches, unrolled": "f32, 4 micro-batches, unrolled (CPU's default)",
    "f32, 4 micro-batches, one loop": "f32, 4 micro-batches, one loop (GPU's and TPU's)",
    "f32, 8 micro-batches, unrolled": "f32, 8 micro-batches, unrolled",
    "f32, 8 micro-batches, one loop": "f32, 8 micro-batches, one loop",
}


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: each precision and micro-batch form's step time, and XLA's temporaries
    and arguments (state and batch) against f32's; in bold where a loop holds one
    micro-batch's activations at a time."""
    rows = []
    f32 = run["memory"]["f32"]["temp_bytes"]
    for name, label in LABELS.items():
        timing, memory = run["candidates"][name], run["memory"][name]
        ratio = f"{memory['temp_bytes'] / f32:.3f}"
        rows.append(
            [
                label,
                f"{timing['median_s'] * 1e3:.1f}",
                f"{timing['ratio_of_totals_vs_baseline']:.3f}",
                f"{memory['temp_bytes'] / 2**20:.2f}",
                f"**{ratio}**" if "one loop" in name else ratio,
                f"{memory['argument_bytes'] / 2**20:.2f}",
            ]
        )
    header = ["candidate", "median ms/step", "total / f32", "temporaries MiB", "temp / f32"]
    return {"table": markdown_table([*header, "arguments MiB"], rows)}


if __name__ == "__main__":
    main()
