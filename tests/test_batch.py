"""batch_sharding, data_shard and shard_batch on one process."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit


def test_batch_sharding_spec_and_errors():
    mesh = meshkit.make_mesh("data=-1")
    assert meshkit.batch_sharding(mesh).spec == P("data")
    with pytest.raises(ValueError) as info:
        meshkit.batch_sharding(mesh, "batch")
    assert "'batch'" in str(info.value) and "['data']" in str(info.value)


@pytest.mark.devices(8)
def test_batch_sharding_over_two_axes():
    mesh = meshkit.make_mesh("replica=2,data=4")
    sharding = meshkit.batch_sharding(mesh, ("replica", "data"))
    assert sharding.spec == P(("replica", "data"))
    batch = meshkit.shard_batch(np.arange(16.0), sharding)
    assert {s.data.shape for s in batch.addressable_shards} == {(2,)}


def test_shard_batch_values_and_placement():
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    n = 4 * jax.device_count()
    local = {"image": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3), "label": np.arange(n)}
    batch = meshkit.shard_batch(local, sharding)
    for key, value in local.items():
        assert batch[key].shape == value.shape and batch[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch[key]), value)
        for shard in batch[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    assert meshkit.shard_batch(local, sharding, global_batch_size=n)["label"].shape == (n,)


@pytest.mark.devices(8)
def test_batch_not_divisible_names_sizes_and_padding():
    mesh = meshkit.make_mesh("data=8")
    with pytest.raises(ValueError) as info:
        meshkit.shard_batch(np.zeros((12, 2)), meshkit.batch_sharding(mesh))
    message = str(info.value)
    assert "12" in message and "8 shards" in message and "pad" in message


def test_shard_batch_rejects_mismatched_and_scalar_leaves():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    n = jax.device_count()
    with pytest.raises(ValueError, match="different numbers of rows"):
        meshkit.shard_batch({"x": np.zeros((n, 1)), "y": np.zeros((2 * n,))}, sharding)
    with pytest.raises(ValueError, match="is a scalar"):
        meshkit.shard_batch({"x": np.float32(1.0)}, sharding)
    with pytest.raises(ValueError, match=r"passed 8 rows, but a global batch of 16"):
        meshkit.shard_batch(np.zeros(8), sharding, global_batch_size=16)
    with pytest.raises(TypeError, match="NamedSharding"):
        meshkit.shard_batch(np.zeros(8), P("data"))  # type: ignore[arg-type]


@pytest.mark.devices(8)
def test_data_shard_single_process_owns_everything():
    mesh = meshkit.make_mesh("data=4,model=2")
    shard = meshkit.data_shard(meshkit.batch_sharding(mesh), 32)
    assert (shard.start, shard.stop, shard.index, shard.count, shard.size) == (0, 32, 0, 1, 32)
    assert np.arange(40)[shard.slice].tolist() == list(range(32))
    replicated = NamedSharding(mesh, P())
    assert meshkit.data_shard(replicated, 5).slice == slice(0, 5)


@pytest.mark.parametrize("devices", [1, 8])
def test_every_placement_path_gives_what_device_put_gives(devices):
    """One device goes through an identity jit, several through device_put: same arrays."""
    if jax.device_count() < devices:
        pytest.skip(f"needs {devices} devices")
    mesh = meshkit.make_mesh(f"data={devices}", devices=jax.devices()[:devices])
    sharding = meshkit.batch_sharding(mesh)
    rows = 2 * devices
    local = {
        "image": np.random.default_rng(0).normal(size=(rows, 3, 2)),  # float64 on the host
        "label": np.arange(rows, dtype=np.int64),
        "mask": np.arange(rows) % 3 > 0,
    }
    placed = meshkit.shard_batch(local, sharding, global_batch_size=rows)
    reference = jax.device_put(local, sharding)
    for key in local:
        assert placed[key].sharding == reference[key].sharding == sharding
        assert placed[key].dtype == reference[key].dtype
        np.testing.assert_array_equal(np.asarray(placed[key]), np.asarray(reference[key]))
    local["image"][:] = 0  # the placed batch is a copy, not a view of the host array
    assert np.asarray(placed["image"]).any()
