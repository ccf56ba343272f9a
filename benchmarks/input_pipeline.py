"""Encoded-image input: JPEG decode and augmentation, in images per second per host.

    python -m benchmarks input_pipeline                 # 0, 1 and 2 Grain workers
    python -m benchmarks.input_pipeline --workers 0,1,2,4,8   # on a bigger host

The embedded digits are written as JPEG image records at 32×32, 64×64 and 256×256
(a few seconds, once per run). For each size, ``TrainPipeline`` with the image
classification recipe's training transform (decode, Inception-style random-resized
crop, flip, normalise; 256×256 images are cropped to 224×224) runs as:

- ``threads=0``: examples read and transformed in the caller's thread, one by one;
- ``threads=2``: two Grain threads (the recipe's default);
- ``workers=N``: N Grain worker processes, each building whole batches.

Candidates run interleaved (A B C ...). Each round starts a fresh iterator at a new
step, takes one batch (start-up: thread pools, worker processes; reported separately)
and then times ``BATCHES`` batches of 128 images. Last, the recipe's train step
(ResNet-18, small-image stem, width 16, 32×32, batch 128, on 8 fake CPU devices) is
timed, so
the table shows whether the input keeps up with the model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import meshkit

BATCH = 128
BATCHES = 20
ROUNDS = 3
SIZES = {"32x32": (32, 32), "64x64": (64, 64), "256x256 -> 224": (256, 224)}
"""Image sets: (stored side, trained side)."""


def pipelines(directory: Path, stored: int, trained: int, workers: list[int]) -> dict:
    from meshkit import data
    from meshkit.data import image

    records = data.write_digits_images(directory / f"digits_{stored}", size=stored)
    source = data.image_records(records["train"])
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    transform = image.train_transform(
        trained, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD, scale=(0.35, 1.0)
    )
    settings = {"threads=0": (0, 0), "threads=2": (2, 0)}
    settings |= {f"workers={n}": (0, n) for n in workers if n > 0}
    return {
        name: data.TrainPipeline(
            source,
            global_batch_size=BATCH,
            sharding=sharding,
            transform=transform,
            num_threads=threads,
            worker_count=count,
        )
        for name, (threads, count) in settings.items()
    }


def measure_pipelines(candidates: dict) -> dict[str, dict[str, float]]:
    """Steady-state seconds per batch and start-up seconds, interleaved round by round."""
    seconds = {name: [] for name in candidates}
    startup = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(ROUNDS):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            stream = iter(candidates[name].dataset(start_step=round_index * (BATCHES + 1)))
            next(stream)
            first = time.perf_counter()
            for _ in range(BATCHES):
                next(stream)
            seconds[name].append((time.perf_counter() - first) / BATCHES)
            startup[name].append(first - start)
            del stream  # stops its threads or worker processes
    return {
        name: {
            "median_s_per_batch": statistics.median(seconds[name]),
            "images_per_s": BATCH / statistics.median(seconds[name]),
            "startup_s": statistics.median(startup[name]),
        }
        for name in names
    }


def model_step_seconds() -> float:
    """Median seconds of the recipe's default train step (ResNet-18 at width 16, 32×32,
    batch 128)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from meshkit import train
    from meshkit.models import MODELS

    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    module = MODELS["resnet18"](num_classes=10, stem="cifar", width=16)
    model = train.linen_model(module, jnp.zeros((1, 32, 32, 3)))
    state = train.create_train_state(model, optax.sgd(0.1, momentum=0.9), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    rng = np.random.default_rng(0)
    batch = meshkit.shard_batch(
        {
            "image": rng.normal(size=(BATCH, 32, 32, 3)).astype(np.float32),
            "label": rng.integers(0, 10, BATCH).astype(np.int32),
        },
        sharding,
    )
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", default="0,1,2", help="worker counts, e.g. 0,1,2,4")
    args = parser.parse_args()
    workers = [int(n) for n in args.workers.split(",")]
    meshkit.distributed.initialize(cpu_devices=8)
    from benchmarks._harness import save

    results: dict = {"batch": BATCH, "batches_per_round": BATCHES, "rounds": ROUNDS}
    with tempfile.TemporaryDirectory() as directory:
        for label, (stored, trained) in SIZES.items():
            rows = measure_pipelines(pipelines(Path(directory), stored, trained, workers))
            print(f"\nJPEG {label}, batch {BATCH}: decode + crop + flip + normalise")
            print(f"{'candidate':<12} {'ms/batch':>10} {'images/s':>10} {'start-up s':>11}")
            for name, row in rows.items():
                print(
                    f"{name:<12} {row['median_s_per_batch'] * 1e3:>10.1f} "
                    f"{row['images_per_s']:>10,.0f} {row['startup_s']:>11.2f}"
                )
            results[label] = rows
    step = model_step_seconds()
    print(
        f"\nResNet-18 (width 16) train step, 32x32, batch {BATCH}, 8 devices: {step * 1e3:.0f} ms "
        f"= {BATCH / step:,.0f} images/s to feed"
    )
    results["resnet18_step"] = {"median_s": step, "images_per_s": BATCH / step}
    save("input_pipeline", results)


if __name__ == "__main__":
    main()
