"""Data pipelines on 2 processes × 4 devices against 1 process × 8 devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import meshkit
from meshkit.data import ArraySource, EvalPipeline, GlobalBatchIterator, TrainPipeline
from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

STEPS = 7  # more than one epoch of 100 examples at batch 16


def source() -> ArraySource:
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    return ArraySource({"x": x, "y": np.arange(100, dtype=np.int32)})


def augment(record, rng):
    return {"x": record["x"] + rng.normal(size=3).astype(np.float32), "y": record["y"]}


def train_stream(mesh: jax.sharding.Mesh) -> list[dict[str, np.ndarray]]:
    pipeline = TrainPipeline(
        source(),
        global_batch_size=16,
        sharding=meshkit.batch_sharding(mesh),
        seed=11,
        transform=augment,
    )
    with GlobalBatchIterator(pipeline) as batches:
        return [meshkit.to_host(next(batches)) for _ in range(STEPS)]


def child_train_data_axis() -> list[dict[str, np.ndarray]]:
    return train_stream(meshkit.make_mesh("data=-1"))


def child_train_replica_axis() -> list[dict[str, np.ndarray]]:
    devices = sorted(jax.devices(), key=lambda d: (d.id % 4, d.process_index))
    return train_stream(meshkit.make_mesh("data=4,replica=2", devices=devices))


def child_eval(n: int) -> dict:
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
        "indices": np.concatenate(indices),
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
def test_replica_axis_across_processes_gives_the_same_batches():
    one_process = train_stream(meshkit.make_mesh("data=-1"))
    for stream in run_processes(child_train_replica_axis):
        assert_same_stream(stream, one_process)


def test_eval_4097_examples_with_unequal_per_process_counts():
    results = run_processes(child_eval, 4097)
    assert [r["steps"] for r in results] == [17, 17]
    # each process's devices hold 4 of 8 shards: process 0 gets the one real row of the last batch
    assert [r["local_real"] for r in results] == [2049, 2048]
    for r in results:
        np.testing.assert_array_equal(r["indices"], np.arange(4097))
