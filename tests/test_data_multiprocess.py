"""Data pipelines on 2 processes × 4 devices against 1 process × 8 devices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import meshkit
from meshkit.data import (
    ArraySource,
    EvalPipeline,
    GlobalBatchIterator,
    InputSettings,
    TrainPipeline,
)
from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

STEPS = 7  # more than one epoch of 100 examples at batch 16


def source() -> ArraySource:
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    return ArraySource({"x": x, "y": np.arange(100, dtype=np.int32)})


def augment(record, rng):
    return {"x": record["x"] + rng.normal(size=3).astype(np.float32), "y": record["y"]}


def train_stream(mesh: jax.sharding.Mesh, placement: Any = "auto") -> list[dict[str, np.ndarray]]:
    pipeline = TrainPipeline(
        source(),
        global_batch_size=16,
        sharding=meshkit.batch_sharding(mesh),
        seed=11,
        transform=augment,
        input_settings=InputSettings(placement=placement),
    )
    with GlobalBatchIterator(pipeline) as batches:
        return [meshkit.to_host(next(batches)) for _ in range(STEPS)]


def child_train_data_axis() -> list[dict[str, np.ndarray]]:
    return train_stream(meshkit.make_mesh("data=-1"))


def child_train_placed_by_threads() -> list[dict[str, np.ndarray]]:
    return train_stream(meshkit.make_mesh("data=-1"), placement="thread")


CHUNKS = (1, 4, 3, 3, 2, 4, 4)


def chunk_stream(placement: str) -> list[dict[str, np.ndarray]]:
    """Chunks of several sizes as ``fit``'s host feed stacks them."""
    from meshkit.data._feed import Feed

    pipeline = TrainPipeline(
        source(),
        global_batch_size=16,
        sharding=meshkit.batch_sharding(meshkit.make_mesh("data=-1")),
        seed=11,
        input_settings=InputSettings(placement=placement),  # type: ignore[arg-type]
    )
    feed = Feed(pipeline, largest=max(CHUNKS))
    chunks = []
    try:
        for n in CHUNKS:
            _, xs, offset = feed.next(n)
            chunks.append({k: v[offset : offset + n] for k, v in meshkit.to_host(xs).items()})
    finally:
        feed.close()
    return chunks


def child_chunks_placed_by_threads() -> list[dict[str, np.ndarray]]:
    return chunk_stream("thread")


def child_train_replica_axis() -> list[dict[str, np.ndarray]]:
    devices = sorted(jax.devices(), key=lambda d: (d.id % 4, d.process_index))
    return train_stream(meshkit.make_mesh("data=4,replica=2", devices=devices))


def child_eval(n: int) -> dict[str, Any]:
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    pipeline = EvalPipeline(
        ArraySource({"x": np.arange(n, dtype=np.float32)}), global_batch_size=256, sharding=sharding
    )
    local_real = 0
    indices = []
    with GlobalBatchIterator(pipeline) as batches:
        for batch in batches:
            local_real += sum(int(s.data.sum()) for s in batch["mask"].addressable_shards)
            host = meshkit.to_host(batch)
            indices.append(host["index"][host["mask"]])
    return {
        "steps": pipeline.num_steps,
        "local_real": local_real,
        "indices": np.concatenate(indices) if indices else np.zeros(0, np.int64),
    }


def assert_same_stream(a, b):
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], y["y"])


@pytest.mark.devices(8)
def test_two_processes_see_the_same_global_batches_as_one():
    one_process = train_stream(meshkit.make_mesh("data=-1"))
    for stream in run_processes(child_train_data_axis):
        assert_same_stream(stream, one_process)


@pytest.mark.devices(8)
def test_placing_threads_on_two_processes_give_the_same_global_batches_as_one():
    """Each process's thread builds its global arrays from its own rows (no collective)."""
    one_process = train_stream(meshkit.make_mesh("data=-1"))
    for stream in run_processes(child_train_placed_by_threads):
        assert_same_stream(stream, one_process)


@pytest.mark.devices(8)
def test_placing_threads_on_two_processes_build_the_same_chunks_as_one_loop():
    """Chunks each process's thread stacks, and those rebuilt where the size changes,
    hold the same steps as one process's loop."""
    one_process = chunk_stream("loop")
    for stream in run_processes(child_chunks_placed_by_threads):
        assert len(stream) == len(CHUNKS)
        for got, expected in zip(stream, one_process, strict=True):
            np.testing.assert_array_equal(got["x"], expected["x"])
            np.testing.assert_array_equal(got["y"], expected["y"])


@pytest.mark.devices(8)
def test_replica_axis_across_processes_gives_the_same_batches():
    one_process = train_stream(meshkit.make_mesh("data=-1"))
    for stream in run_processes(child_train_replica_axis):
        assert_same_stream(stream, one_process)


def child_eval_sizes(sizes: list[int]) -> list[dict]:
    return [child_eval(n) for n in sizes]


def test_eval_every_example_once_with_unequal_per_process_counts():
    sizes = [0, 1, 7, 8, 9, 4097]
    results = run_processes(child_eval_sizes, sizes)
    for i, n in enumerate(sizes):
        per_process = [r[i] for r in results]
        assert [r["steps"] for r in per_process] == [-(-n // 256)] * 2
        for r in per_process:
            np.testing.assert_array_equal(r["indices"], np.arange(n))
        assert sum(r["local_real"] for r in per_process) == n
    # 4097 = 16 full batches + 1: process 0's devices hold the one real row of the last batch
    assert [r[-1]["local_real"] for r in results] == [2049, 2048]


def first_batches_with(worker_count: int) -> list[np.ndarray]:
    pipeline = TrainPipeline(
        source(),
        global_batch_size=16,
        sharding=meshkit.batch_sharding(meshkit.make_mesh("data=-1")),
        seed=11,
        transform=augment,
        input_settings=InputSettings(worker_count=worker_count),
    )
    stream = iter(pipeline.dataset(start_step=2))
    return [next(stream)["x"] for _ in range(4)]


def test_grain_worker_processes_give_the_same_batches_as_threads():
    # Two workers: each builds every other batch, and their outputs interleave in order.
    for a, b in zip(first_batches_with(0), first_batches_with(2), strict=True):
        np.testing.assert_array_equal(a, b)


def test_worker_processes_send_uint8_image_batches_and_the_caller_normalises(tmp_path):
    # image.train_transform's batch stops before normalising (uint8 crosses between the
    # processes, a quarter of the bytes); the pipeline finishes it in this process. Skipping
    # the finish, or doing it twice, changes the batches.
    from meshkit.data import image, image_records, write_digits_images

    records = write_digits_images(tmp_path / "digits", size=16)
    transform = image.train_transform(12, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)

    def batches(worker_count: int) -> list[dict[str, np.ndarray]]:
        pipeline = TrainPipeline(
            image_records(records["train"]),
            global_batch_size=16,
            sharding=meshkit.batch_sharding(meshkit.make_mesh("data=-1")),
            transform=transform,
            input_settings=InputSettings(num_threads=0, worker_count=worker_count),
        )
        assert pipeline._unfinished_batch(0)["image"].dtype == np.uint8
        stream = iter(pipeline.dataset(start_step=1))
        return [next(stream) for _ in range(3)]

    for here, there in zip(batches(0), batches(2), strict=True):
        assert there["image"].dtype == np.float32
        for key in here:
            np.testing.assert_array_equal(here[key], there[key])
