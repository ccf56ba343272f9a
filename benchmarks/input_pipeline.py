"""Encoded-image input against the decode limit: images per second per host.

    python -m benchmarks input_pipeline                  # the table below, this host
    python -m benchmarks.input_pipeline --workers 0,2,4  # more worker counts

The embedded digits are written as JPEG image records (quality 90) at 32×32, 64×64 and
256×256 (a few seconds, once per run). For each size:

- **limit**: a plain loop of PIL decode + random-resized crop + flip + normalise, one
  image at a time on one core, with nothing else (no pipeline, no stacking); times the
  host's cores, the most any input pipeline could reach on them.
- ``TrainPipeline`` with the image classification recipe's training transform
  (Inception-style random-resized crop with scale (0.35, 1), flip, normalise; 256×256
  images are cropped to 224×224), as:
  - ``threads=0``: batches built in the caller's thread;
  - ``threads=N``: N Grain threads, each building whole batches;
  - ``workers=N``: N Grain worker processes, each building whole batches;
  - ``host default``: ``meshkit.data.image.input_settings(side)``;
  - ``decode only`` (small images): the same settings with ``decode_transform``: the
    host ships uint8 batches and the train step augments them
    (``device_augmentation``), the recipe's default below 128 pixels a side. The
    device's cost for a batch (jitted, on the 8 fake CPU devices) is reported apart.
- ``members=K`` (small images): the default settings reading K orders of the same
  images at once (a ``MemberTrainPipeline``, as a sweep with a ``data_seed`` per member
  reads them), counted in images delivered (K per row).

Candidates run interleaved (A B C ...), each round on a fresh iterator at a new step:
one batch first (start-up: threads, worker processes; reported apart), then
``BATCHES`` batches of 128 rows timed. The recipe's train step (ResNet-18, width 16,
32×32, batch 128, 8 fake CPU devices) is timed last, to show whether input keeps up.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import meshkit
from benchmarks.quoted import markdown_table

BATCH = 128
BATCHES = 12
ROUNDS = 5
LIMIT_IMAGES = 1280
SCALE = (0.35, 1.0)
SIZES = {"32x32": (32, 32), "64x64": (64, 64), "256x256 -> 224": (256, 224)}
"""Image sets: (stored side, trained side)."""


def raw_loop(encoded: list[bytes], trained: int) -> Callable[[int], tuple[float, float]]:
    """The limit on one core: decode, crop, flip and normalise images in a plain loop.

    As a candidate: each round handles ``BATCHES * BATCH`` images, one at a time, and
    reports seconds per ``BATCH`` of them (no start-up).
    """
    from PIL import Image

    from meshkit.data.image import IMAGENET_MEAN, IMAGENET_STD

    # Normalisation as one multiply and one subtract over whole rows (the per-channel
    # values repeated along a row: numpy's inner loop then runs over a row, not over
    # the 3 channels, 7x faster), so the limit is the loop written well.
    scale = np.tile(np.asarray(IMAGENET_STD, np.float32) ** -1 / 255, trained)
    offset = np.tile(np.asarray(IMAGENET_MEAN, np.float32) / np.asarray(IMAGENET_STD), trained)
    scale, offset = scale.astype(np.float32), offset.astype(np.float32)
    log_ratio = (math.log(3 / 4), math.log(4 / 3))

    def run(round_index: int) -> tuple[float, float]:
        rng = np.random.default_rng(round_index)
        start = time.perf_counter()
        for index in range(BATCHES * BATCH):
            with Image.open(io.BytesIO(encoded[index % len(encoded)])) as img:
                width, height = img.size
                area = width * height * rng.uniform(*SCALE)
                aspect = math.exp(rng.uniform(*log_ratio))
                w = min(width, round(math.sqrt(area * aspect)))
                h = min(height, round(math.sqrt(area / aspect)))
                left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
                box = (float(left), float(top), float(left + w), float(top + h))
                pixels = np.asarray(img.convert("RGB").resize((trained, trained), box=box))
            if rng.random() < 0.5:
                pixels = pixels[:, ::-1]
            _ = pixels.astype(np.float32).reshape(trained, -1) * scale - offset
        return 0.0, (time.perf_counter() - start) / BATCHES

    return run


def pipeline_run(pipeline: Any) -> Callable[[int], tuple[float, float]]:
    """A pipeline as a candidate: a fresh iterator at a new step, one batch (start-up),
    then ``BATCHES`` batches timed."""

    def run(round_index: int) -> tuple[float, float]:
        start = time.perf_counter()
        stream = iter(pipeline.dataset(start_step=round_index * (BATCHES + 1)))
        next(stream)
        first = time.perf_counter()
        for _ in range(BATCHES):
            next(stream)
        seconds = (time.perf_counter() - first) / BATCHES
        del stream  # stops its threads or worker processes; wait until they are gone,
        gc.collect()  # or their shutdown would slow the next candidate down
        for child in multiprocessing.active_children():
            child.join(timeout=30)
        return first - start, seconds

    return run


def pipelines(source: Any, trained: int, workers: list[int], members: list[int]) -> dict:
    from meshkit import data
    from meshkit.data import image
    from meshkit.ensemble import EnsembleLayout, MemberTrainPipeline

    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    transform = image.train_transform(
        trained, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD, scale=SCALE
    )
    default = image.input_settings(trained)
    settings: dict[str, tuple[data.InputSettings, Any]] = {
        "threads=0": (data.InputSettings(num_threads=0), transform),
        "threads=2": (data.InputSettings(num_threads=2), transform),
    }
    settings |= {
        f"workers={n}": (data.InputSettings(worker_count=n), transform) for n in workers if n > 0
    }
    # The host default is one of the candidates: the same settings measured once, under
    # both names (two runs of one setting differed by 15% in one run, which is noise).
    same = [name for name, (chosen, _) in settings.items() if _same_settings(chosen, default)]
    if same:
        settings[f"{same[0]} = host default"] = settings.pop(same[0])
    else:
        settings["host default"] = (default, transform)
    if trained < image.DECODE_BOUND_SIDE:  # the recipe augments small images on the device
        settings["decode only"] = (default, image.decode_transform(trained))
    candidates: dict[str, tuple[Callable[[int], tuple[float, float]], int]] = {
        name: (
            pipeline_run(
                data.TrainPipeline(
                    source,
                    global_batch_size=BATCH,
                    sharding=sharding,
                    transform=chosen_transform,
                    input_settings=chosen,
                )
            ),
            1,
        )
        for name, (chosen, chosen_transform) in settings.items()
    }
    for k in members:
        layout = EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), k)
        pipeline = MemberTrainPipeline(
            source,
            k,
            global_batch_size=BATCH,
            sharding=layout.batch_sharding,
            transform=transform,
            input_settings=default,
        )
        candidates[f"members={k}"] = (pipeline_run(pipeline), k)
    return candidates


def _same_settings(settings: Any, default: Any) -> bool:
    """Whether two ``InputSettings`` build the same pipeline (unset threads count as 0)."""
    return (settings.num_threads or 0, settings.worker_count) == (
        default.num_threads or 0,
        default.worker_count,
    )


def host_default_row(rows: dict[str, Any]) -> str:
    """The name of the row measuring ``input_settings``' choice."""
    return next(name for name in rows if name.endswith("host default"))


def measure(candidates: dict) -> dict[str, dict[str, float]]:
    """Steady-state seconds per batch and start-up seconds, interleaved round by round."""
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    startup: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(ROUNDS):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run, _ = candidates[name]
            started, per_batch = run(round_index)
            seconds[name].append(per_batch)
            startup[name].append(started)
    return {
        name: {
            "median_s_per_batch": statistics.median(seconds[name]),
            "images_per_s": BATCH * candidates[name][1] / statistics.median(seconds[name]),
            "startup_s": statistics.median(startup[name]),
        }
        for name in names
    }


def device_augment_seconds(stored: int, trained: int) -> float:
    """Median seconds of ``device_augmentation`` (the recipe's crop, flip and normalise)
    on a uint8 batch of ``stored``-side images, jitted, on this process's devices."""
    import jax

    from meshkit.data import image

    augment = jax.jit(
        image.device_augmentation(
            trained, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD, scale=SCALE
        )
    )
    pixels = np.random.default_rng(0).integers(0, 256, (BATCH, stored, stored, 3), np.uint8)
    images = meshkit.shard_batch(pixels, meshkit.batch_sharding(meshkit.make_mesh("data=-1")))
    key = jax.random.key(0)
    augment(images, key).block_until_ready()
    times = []
    for index in range(10):
        start = time.perf_counter()
        augment(images, jax.random.fold_in(key, index)).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_step_seconds() -> float:
    """Median seconds of the recipe's default train step (ResNet-18 at width 16, 32×32,
    batch 128)."""
    import jax
    import jax.numpy as jnp
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
    parser.add_argument("--workers", default="1,2", help="worker counts, e.g. 1,2,4")
    parser.add_argument("--members", default="4,16", help="member counts, e.g. 4,16")
    parser.add_argument("--sizes", default=",".join(SIZES), help="image sets to measure")
    args = parser.parse_args()
    workers = [int(n) for n in args.workers.split(",") if n]
    members = [int(n) for n in args.members.split(",") if n]
    meshkit.distributed.initialize(cpu_devices=8)
    from benchmarks._harness import save
    from meshkit import data
    from meshkit.data import image

    cores = len(os.sched_getaffinity(0))
    results: dict = {"batch": BATCH, "batches_per_round": BATCHES, "rounds": ROUNDS}
    results["cores"] = cores
    with tempfile.TemporaryDirectory() as directory:
        for label in args.sizes.split(","):
            stored, trained = SIZES[label]
            records = data.write_digits_images(Path(directory) / f"d{stored}", size=stored)
            source = data.image_records(records["train"])
            encoded = [bytes(source[i]["image"]) for i in range(min(LIMIT_IMAGES, len(source)))]
            candidates = {"limit, 1 core": (raw_loop(encoded, trained), 1)}
            small = trained < image.DECODE_BOUND_SIDE  # sweeps' member orders: small images
            candidates |= pipelines(source, trained, workers, members if small else [])
            rows = measure(candidates)
            one_core = rows.pop("limit, 1 core")["images_per_s"]
            limit = one_core * cores
            print(f"\nJPEG {label}, batch {BATCH}: decode + crop + flip + normalise")
            print(f"limit: {one_core:,.0f} images/s on one core × {cores} cores = {limit:,.0f}")
            header = ("candidate", "ms/batch", "images/s", "× limit", "start-up s")
            print("{:<12} {:>10} {:>10} {:>8} {:>11}".format(*header))
            for name, row in rows.items():
                row["ratio_to_limit"] = row["images_per_s"] / limit
                print(
                    f"{name:<12} {row['median_s_per_batch'] * 1e3:>10.1f} "
                    f"{row['images_per_s']:>10,.0f} {row['ratio_to_limit']:>8.2f} "
                    f"{row['startup_s']:>11.2f}"
                )
            small = trained < image.DECODE_BOUND_SIDE
            host_row = host_default_row(rows)
            host_modes = [name for name in rows if not name.startswith(("members=", "decode"))]
            fastest = max(host_modes, key=lambda name: rows[name]["images_per_s"])
            print(
                f"fastest host setting: {fastest} ({rows[fastest]['ratio_to_limit']:.2f}x limit); "
                f"the host default is {host_row} ({rows[host_row]['ratio_to_limit']:.2f}x)"
            )
            default = rows["decode only" if small else host_row]
            augment = device_augment_seconds(stored, trained)
            chosen = "decode only + device augmentation" if small else "host default"
            print(
                f"recipe default: {chosen} ({default['ratio_to_limit']:.2f}× limit); "
                "device augmentation of a batch on "
                f"8 CPU devices: {augment * 1e3:.1f} ms"
            )
            results[label] = {
                "one_core_limit_images_per_second": one_core,
                "limit_images_per_second": limit,
                "default_images_per_second": default["images_per_s"],
                "default_settings": dataclasses.asdict(image.input_settings(trained)),
                "default_augmentation": "device" if small else "host",
                "host_default_images_per_second": rows[host_row]["images_per_s"],
                "host_default_row": host_row,
                "fastest_host_setting": fastest,
                "device_augment_ms_per_batch": augment * 1e3,
                "candidates": rows,
            }
    step = model_step_seconds()
    print(
        f"\nResNet-18 (width 16) train step, 32x32, batch {BATCH}, 8 devices: {step * 1e3:.0f} ms "
        f"= {BATCH / step:,.0f} images/s to feed"
    )
    results["resnet18_step"] = {"median_s": step, "images_per_s": BATCH / step}
    save("input_pipeline", results, tables)


def _sizes(run: dict[str, Any]) -> list[str]:
    """The image sets of a run, in the order measured."""
    return [key for key, value in run.items() if isinstance(value, dict) and "candidates" in value]


def _label(size: str) -> str:
    """``32×32``, ``256×256 → 224``."""
    return size.replace("x", "×").replace("->", "→")


def _images(rate: float, limit: float) -> str:
    return f"{rate:,.0f} ({rate / limit:.2f}×)"


def _settings_table(run: dict[str, Any], members: bool) -> str:
    """Images per second of each setting (host settings and decode-only input, or K
    member orders) per image size, against the limit; the host default in bold, and
    for host settings the fastest named."""
    columns: list[str] = []
    for size in _sizes(run):
        for name in run[size]["candidates"]:
            base = name.split(" = ")[0]
            if base.startswith("members=") == members and base not in columns:
                columns.append(base)
    rows = []
    for size in _sizes(run):
        measured, limit = run[size], run[size]["limit_images_per_second"]
        by_base = {name.split(" = ")[0]: name for name in measured["candidates"]}
        if members and not any(base in by_base for base in columns):
            continue
        cells = [_label(size), f"{limit:,.0f}"]
        for base in columns:
            name = by_base.get(base)
            cell = _images(measured["candidates"][name]["images_per_s"], limit) if name else ""
            cells.append(f"**{cell}**" if name == measured["host_default_row"] else cell)
        if not members:
            fastest = measured["fastest_host_setting"]
            same = " (the default)" if fastest == measured["host_default_row"] else ""
            cells.append(fastest.split(" = ")[0] + same)
        rows.append(cells)
    header = ["JPEG, trained size", f"limit ({run['cores']} cores)", *columns]
    if members:
        return markdown_table(header, rows)
    return markdown_table(
        [*header, "fastest host setting"], rows, "l" + "r" * len(header[1:]) + "l"
    )


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: every host setting and decode-only input, per image size, against the
    limit; ``defaults``: the host default and the recipe's default as shares of it;
    ``device``: what the devices do per batch (the recipe's train step, the device
    augmentation of decode-only input); ``members``: K member orders at once."""
    defaults, device = [], []
    step = run["resnet18_step"]
    device.append(["the recipe's ResNet-18 train step, 32×32"])
    device[-1] += [f"{step['median_s'] * 1e3:.0f}", f"{step['images_per_s']:,.0f}"]
    for size in _sizes(run):
        measured = run[size]
        limit = measured["limit_images_per_second"]
        host = measured["host_default_images_per_second"] / limit
        default = measured["default_images_per_second"] / limit
        if measured["default_augmentation"] == "device":
            how = "decode only, augmented on the devices"
        elif measured["default_settings"]["num_threads"]:
            how = "threads on the host"
        else:
            how = "workers on the host"
        defaults.append([_label(size), f"{limit:,.0f}", f"{host:.2f}×", f"{default:.2f}× ({how})"])
        augment = measured["device_augment_ms_per_batch"]
        device.append([f"device augmentation, {_label(size)}", f"{augment:.1f}", ""])
    header = ["images", "limit (images/s)", "host default (`input_settings`)", "recipe default"]
    batch = f"ms per batch of {run['batch']}"
    return {
        "table": _settings_table(run, members=False),
        "defaults": markdown_table(header, defaults),
        "device": markdown_table(["on 8 fake CPU devices", batch, "images/s"], device),
        "members": _settings_table(run, members=True),
    }


if __name__ == "__main__":
    main()
