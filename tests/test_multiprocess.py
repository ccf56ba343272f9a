"""2 processes × 4 CPU devices: the pod stand-in.

The functions at the top run inside the child processes (``run_processes`` imports
this module there); the tests compare what they return with numpy references and
with the same computation on 1 process × 8 devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit.testing import ProcessFailedError, run_processes

pytestmark = pytest.mark.multiprocess

BATCH = 32
FEATURES = 5


def global_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        "x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
        "y": rng.normal(size=(BATCH,)).astype(np.float32),
    }


def regression_grad(mesh: jax.sharding.Mesh, batch: dict[str, jax.Array]) -> np.ndarray:
    """Gradient of a mean squared error, batch sharded over data, weights replicated."""
    w = meshkit.replicate(np.linspace(-1, 1, FEATURES, dtype=np.float32), mesh)

    def loss(w, batch):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    grad = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P()))(w, batch)
    return meshkit.to_host(grad)


def numpy_regression_grad(batch: dict[str, np.ndarray]) -> np.ndarray:
    w = np.linspace(-1, 1, FEATURES, dtype=np.float64)
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    return 2 * x.T @ (x @ w - y) / len(y)


def child_data_axis() -> dict:
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    shard = meshkit.data_shard(sharding, BATCH)
    local = {k: v[shard.slice] for k, v in global_batch().items()}
    batch = meshkit.shard_batch(local, sharding)  # global size inferred (one all-gather)
    explicit = meshkit.shard_batch(local, sharding, global_batch_size=BATCH)
    return {
        "shard": (shard.start, shard.stop, shard.index, shard.count),
        "gathered": meshkit.to_host(batch),
        "gathered_explicit": meshkit.to_host(explicit["x"]),
        "grad": regression_grad(mesh, batch),
        "devices": (jax.process_count(), jax.device_count(), jax.local_device_count()),
    }


def child_replica_axis() -> dict:
    # The second mesh axis spans the two processes: process p holds column p, so both
    # processes hold every data block and must load identical, full batches.
    devices = sorted(jax.devices(), key=lambda d: (d.id % 4, d.process_index))
    mesh = meshkit.make_mesh("data=4,replica=2", devices=devices)
    columns = {tuple(d.process_index for d in row) for row in mesh.devices}
    sharding = meshkit.batch_sharding(mesh)
    shard = meshkit.data_shard(sharding, BATCH)
    local = {k: v[shard.slice] for k, v in global_batch().items()}
    batch = meshkit.shard_batch(local, sharding)
    return {
        "columns": columns,
        "shard": (shard.start, shard.stop, shard.index, shard.count),
        "shape": batch["x"].shape,
        "gathered": meshkit.to_host(batch),
        "grad": regression_grad(mesh, batch),
    }


def child_unequal_rows() -> str:
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    rows = 8 if jax.process_index() == 0 else 12
    try:
        meshkit.shard_batch(np.zeros((rows, 2)), sharding)
    except ValueError as error:
        return str(error)
    return "no error"


def child_replicate_host_values() -> np.ndarray:
    mesh = meshkit.make_mesh("data=-1")
    placed = meshkit.replicate({"w": np.arange(4.0)}, mesh)
    doubled = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(placed)
    return meshkit.to_host(doubled)["w"]


def test_data_axis_across_two_processes_matches_numpy_and_one_process():
    results = run_processes(child_data_axis)
    batch = global_batch()
    assert [r["shard"] for r in results] == [(0, 16, 0, 2), (16, 32, 1, 2)]
    reference = numpy_regression_grad(batch)
    for r in results:
        assert r["devices"] == (2, 8, 4)
        for key in batch:
            np.testing.assert_array_equal(r["gathered"][key], batch[key])
        np.testing.assert_array_equal(r["gathered_explicit"], batch["x"])
        np.testing.assert_allclose(r["grad"], reference, rtol=1e-5)
    # the same program on this process's devices (1 × 8 when the suite runs at 8)
    mesh = meshkit.make_mesh("data=-1")
    one_process = regression_grad(mesh, meshkit.shard_batch(batch, meshkit.batch_sharding(mesh)))
    np.testing.assert_allclose(results[0]["grad"], one_process, rtol=1e-6)


def test_replica_axis_spanning_processes_loads_full_identical_batches():
    results = run_processes(child_replica_axis)
    batch = global_batch()
    for r in results:
        assert r["columns"] == {(0, 1)}
        assert r["shard"] == (0, BATCH, 0, 1)
        assert r["shape"] == (BATCH, FEATURES)  # not a silently halved batch
        np.testing.assert_array_equal(r["gathered"]["x"], batch["x"])
        np.testing.assert_allclose(r["grad"], numpy_regression_grad(batch), rtol=1e-5)


def test_unequal_rows_raise_the_same_clear_error_everywhere():
    messages = run_processes(child_unequal_rows)
    for message in messages:
        assert "different numbers of rows" in message and "{0: 8, 1: 12}" in message


def test_replicate_host_values_without_cross_process_transfer():
    for result in run_processes(child_replicate_host_values):
        np.testing.assert_array_equal(result, 2 * np.arange(4.0))


def child_fails() -> None:
    raise ValueError("boom from a child")


def test_failing_child_reports_its_traceback():
    with pytest.raises(ProcessFailedError) as info:
        run_processes(child_fails)
    assert "ValueError: boom from a child" in str(info.value)
    assert "exited with code 1" in str(info.value)


def test_timeout_kills_all_children():
    with pytest.raises(ProcessFailedError, match=r"still running after 2 s"):
        run_processes(["-c", "import time; time.sleep(60)"], timeout=2)


def test_run_processes_rejects_lambdas():
    with pytest.raises(ValueError, match="top level of an importable module"):
        run_processes(lambda: None)


def child_replicas_loading_by_process_index() -> str:
    devices = sorted(jax.devices(), key=lambda d: (d.id % 4, d.process_index))
    mesh = meshkit.make_mesh("data=4,replica=2", devices=devices)
    half = BATCH // 2
    rows = slice(
        jax.process_index() * half, (jax.process_index() + 1) * half
    )  # the classic mistake
    try:
        meshkit.shard_batch(global_batch()["x"][rows], meshkit.batch_sharding(mesh))
    except ValueError as error:
        return str(error)
    return "no error"


def test_replicas_that_load_different_rows_are_caught():
    for message in run_processes(child_replicas_loading_by_process_index):
        assert "Processes [0, 1] hold replicas of the same rows" in message
        assert "not with jax.process_index()" in message
