"""batch_sharding, data_shard and shard_batch on one process."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import train
from meshkit._batch import pad_rows


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


@pytest.mark.devices(8)
def test_a_replicating_axis_does_not_count_as_a_data_shard():
    """On data=4,model=2 the rows split four ways: batches are multiples of 4, not 8."""
    mesh = meshkit.make_mesh("data=4,model=2")
    sharding = meshkit.batch_sharding(mesh)
    assert meshkit.data_shard(sharding, 4).slice == slice(0, 4)
    with pytest.raises(
        ValueError, match="Global batch size 6 must be a positive multiple of the 4"
    ):
        meshkit.data_shard(sharding, 6)
    assert meshkit.data_shard(NamedSharding(mesh, P()), 3).size == 3  # one shard: any size
    with pytest.raises(TypeError, match=r"NamedSharding for the batch, got P\('data',\)"):
        meshkit.data_shard(P("data"), 8)  # type: ignore[arg-type]


def test_pad_rows_fills_with_zeros_or_wraps_and_masks():
    batch = {"x": np.array([[1, 2], [3, 4]]), "y": np.array([5, 6])}
    zeros, mask = pad_rows(batch, 5)
    assert zeros["x"].tolist() == [[1, 2], [3, 4], [0, 0], [0, 0], [0, 0]]
    assert zeros["y"].dtype == batch["y"].dtype and mask.tolist() == [1, 1, 0, 0, 0]
    wrapped, mask = pad_rows(batch, 5, fill="wrap")
    assert wrapped["y"].tolist() == [5, 6, 5, 6, 5] and mask.sum() == 2
    same, mask = pad_rows(batch, 2)
    assert same["y"].tolist() == [5, 6] and mask.all()
    empty, mask = pad_rows({"x": np.zeros((0, 2))}, 2)
    assert empty["x"].shape == (2, 2) and not mask.any()
    with pytest.raises(ValueError, match="got 2 rows, more than the 1 rows"):
        pad_rows(batch, 1)
    with pytest.raises(ValueError, match="cannot wrap around 0 rows"):
        pad_rows({"x": np.zeros((0, 2))}, 2, fill="wrap")


def test_row_count_errors_name_the_caller_and_every_leaf():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    with pytest.raises(ValueError, match=r"pad_rows: the leaves have different.*\{\"\['x'\]\": 3"):
        pad_rows({"x": np.zeros(3), "y": np.zeros(4)}, 8)
    with pytest.raises(ValueError, match=r"shard_batch: leaf \['x'\] is a scalar"):
        meshkit.shard_batch({"x": np.float32(0)}, sharding)
    with pytest.raises(ValueError, match="shard_batch got an empty pytree"):
        meshkit.shard_batch({}, sharding)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, r"global_batch_size must be an int, got True \(bool\)\."),
        (16.0, TypeError, r"got 16\.0 \(float\)"),
        ("16", TypeError, r"got '16' \(str\)"),
    ],
)
def test_sizes_must_be_ints_not_bools_floats_or_strings(value, error, message):
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    with pytest.raises(error, match=message):
        meshkit.data_shard(sharding, value)
    assert meshkit.data_shard(sharding, np.int64(8)).stop == 8  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, r"max_in_flight must be an int >= 1 step, got True \(bool\)\."),
        (0, ValueError, r"max_in_flight must be an int >= 1 step, got 0\."),
    ],
)
def test_bounded_sizes_separate_wrong_types_from_bad_values(value, error, message):
    with pytest.raises(error, match=message):
        train.parts.InFlight(value)
    assert train.parts.InFlight(np.int64(2)).limit == 2  # type: ignore[arg-type]


def test_both_one_device_placements_give_the_same_arrays():
    """On one device a batch is placed by an identity jit (CPU) or jax.device_put
    (accelerators): the same values, dtypes and sharding either way."""
    from meshkit import _batch

    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=1", devices=jax.devices()[:1]))
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
        "label": rng.integers(0, 10, size=16).astype(np.int32),
    }
    by_jit = _batch._one_device_put(sharding)(batch)
    by_put = jax.device_put(batch, sharding)
    for key, value in batch.items():
        assert by_jit[key].sharding.is_equivalent_to(by_put[key].sharding, value.ndim)
        assert by_jit[key].dtype == by_put[key].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(by_jit[key]), np.asarray(by_put[key]))
    assert _batch._identity_jit_places_faster(sharding) == (jax.devices()[0].platform == "cpu")
    if jax.device_count() > 1:
        several = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
        assert not _batch._identity_jit_places_faster(several)
