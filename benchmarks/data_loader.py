"""Loader throughput: how many examples per second meshkit.data delivers.

    python -m benchmarks data_loader        # 1 and 8 fake CPU devices, in two processes

For the embedded digits (28×28×1, batch 128) and a synthetic 32×32×3 uint8 source
(10,000 examples, batch 256), three candidates run interleaved (A B C A B C ...), each
consuming the same number of batches per round:

- numpy indexing: the source arrays indexed with each batch's rows; the floor.
- pipeline: ``TrainPipeline.dataset()``: Grain threads building this process's batches.
- global iterator: ``GlobalBatchIterator``: the same, placed on the devices as global arrays.
"""

from __future__ import annotations

import subprocess
import sys

BATCHES_PER_ROUND = 20
ROUNDS = 10


def measure(devices: int) -> dict:
    import meshkit

    meshkit.distributed.initialize(cpu_devices=devices)
    import jax

    from benchmarks._harness import interleave, report
    from meshkit.data import GlobalBatchIterator, TrainPipeline, digits, synthetic

    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    results = {}
    for name, source, batch_size in [
        ("digits 28x28x1", digits("train", image_size=28), 128),
        ("synthetic 32x32x3 uint8", synthetic(10_000, (32, 32, 3)), 256),
    ]:
        pipeline = TrainPipeline(source, global_batch_size=batch_size, sharding=sharding, seed=0)
        host_stream = iter(pipeline.dataset())
        device_stream = GlobalBatchIterator(pipeline)
        step = 0

        def numpy_indexing(pipeline=pipeline, source=source):
            nonlocal step
            for _ in range(BATCHES_PER_ROUND):
                rows = pipeline.global_indices(step)
                {key: value[rows] for key, value in source.arrays.items()}
                step += 1

        def grain_pipeline(stream=host_stream):
            for _ in range(BATCHES_PER_ROUND):
                next(stream)

        def global_iterator(stream=device_stream):
            for _ in range(BATCHES_PER_ROUND):
                jax.block_until_ready(next(stream))

        timings = interleave(
            {
                "numpy indexing": numpy_indexing,
                "TrainPipeline": grain_pipeline,
                "GlobalBatchIterator": global_iterator,
            },
            rounds=ROUNDS,
        )
        device_stream.close()
        table = report(
            f"{name}, batch {batch_size}, {devices} device(s), {BATCHES_PER_ROUND} batches a round",
            timings,
            baseline="numpy indexing",
            unit="round",
        )
        for candidate, row in table["candidates"].items():
            row["examples_per_s"] = BATCHES_PER_ROUND * batch_size / row["median_s"]
            print(f"  {candidate:<24} {row['examples_per_s']:>12,.0f} examples/s")
        results[name] = table
    return results


def main() -> None:
    if len(sys.argv) > 1:
        import json

        print("RESULT " + json.dumps(measure(int(sys.argv[1]))))
        return
    from benchmarks._harness import save

    combined = {}
    for devices in (1, 8):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.data_loader", str(devices)],
            capture_output=True,
            text=True,
            check=True,
        )
        lines = out.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith("RESULT ")))
        import json

        combined[f"{devices} devices"] = json.loads(
            next(line for line in lines if line.startswith("RESULT "))[7:]
        )
    save("data_loader", combined)


if __name__ == "__main__":
    main()
