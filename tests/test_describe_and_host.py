"""describe, replicate and to_host on one process; counting compilations."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshkit


def _row(report: str, path: str) -> list[str]:
    line = next(line for line in report.splitlines() if line.startswith(path + " "))
    return line.split()


@pytest.mark.devices(8)
def test_describe_tree_reports_bytes_per_device_against_numpy():
    mesh = meshkit.make_mesh("data=4,model=2")
    tree = {
        "kernel": jax.ShapeDtypeStruct((800, 256), jnp.float32),
        "bias": jax.ShapeDtypeStruct((256,), jnp.bfloat16),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    rules = meshkit.PartitionRules([("kernel", P("data", "model"))])
    shardings = meshkit.infer_shardings(tree, mesh, rules)
    report = meshkit.describe(tree, shardings)
    assert "Mesh data=4 × model=2" in report and "axis types (Auto, Auto)" in report
    kernel = _row(report, "kernel")
    assert kernel[1:3] == ["(800,", "256)"] and "float32" in kernel
    assert f"{800 * 256 * 4 / 8 / 1024:.1f}" in kernel  # 100.0 KiB per device
    assert "P(" in " ".join(_row(report, "bias"))
    assert _row(report, "step")[-4:] == ["4", "B", "4", "B"]  # whole bytes below 1 KiB
    per_device = 800 * 256 * 4 / 8 + 256 * 2 + 4  # 102,916 bytes
    total = 800 * 256 * 4 + 256 * 2 + 4  # 819,716 bytes
    assert (per_device / 1024, total / 1024) == pytest.approx((100.504, 800.504), abs=1e-3)
    assert report.splitlines()[-1] == "3 leaves: 800.5 KiB in all, 100.5 KiB per device"


def test_describe_concrete_arrays_and_host_leaves():
    mesh = meshkit.make_mesh("data=-1")
    n = jax.device_count()
    batch = meshkit.shard_batch(
        {"x": np.zeros((2 * n, 3), np.float32)}, meshkit.batch_sharding(mesh)
    )
    report = meshkit.describe({"batch": batch, "host": np.zeros(5)})
    assert "P('data')" in report
    assert "host (not on devices)" in report
    x_line = next(line for line in report.splitlines() if line.startswith("batch/x"))
    assert f"  {2 * 3 * 4} B  " in x_line  # two rows of 3 float32 on each device


def test_describe_mesh_grid_lists_every_device():
    mesh = meshkit.make_mesh("data=-1")
    report = meshkit.describe(mesh)
    for device in jax.devices():
        assert f"{device.id}@p0" in report
    with pytest.raises(ValueError, match="takes no shardings"):
        meshkit.describe(mesh, {})


def test_describe_shardings_structure_mismatch():
    mesh = meshkit.make_mesh("data=-1")
    shardings = meshkit.infer_shardings({"a": np.zeros(2)}, mesh)
    with pytest.raises(ValueError, match="1 leaves but the tree has 2"):
        meshkit.describe({"a": np.zeros(2), "b": np.zeros(2)}, shardings)


def test_replicate_and_to_host_round_trip():
    mesh = meshkit.make_mesh("data=-1")
    tree = {"w": np.arange(6.0).reshape(2, 3), "step": np.int32(3), "s": 1.5}
    placed = meshkit.replicate(tree, mesh)
    for leaf in jax.tree.leaves(placed):
        assert (
            leaf.sharding.is_fully_replicated
            and len(leaf.sharding.device_set) == jax.device_count()
        )
    back = meshkit.to_host(placed)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert back["step"] == 3 and back["s"] == 1.5
    assert isinstance(back["w"], np.ndarray)
    with pytest.raises(TypeError, match=r"needs a jax\.sharding\.Mesh"):
        meshkit.replicate(tree, "data")  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["one device", "the mesh"])
def test_replicate_copies_a_device_array_so_a_donating_step_cannot_delete_it(where: str):
    """On 8 devices an array on one device is resharded, and JAX's ``device_put`` kept
    its buffer as the first device's shard even with ``may_alias=False``."""
    mesh = meshkit.make_mesh("data=-1")
    original = jnp.arange(4.0)
    if where == "the mesh":
        original = jax.device_put(original, jax.sharding.NamedSharding(mesh, P()))
    placed = meshkit.replicate({"w": original}, mesh)["w"]
    donating = jax.jit(lambda x: x + 1, donate_argnums=0)
    assert donating(placed).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert not original.is_deleted() and original.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.once  # one process of its own per run; no device count involved
def test_a_program_loaded_from_the_persistent_cache_counts_as_a_compilation(tmp_path):
    """With JAX's persistent compilation cache, a second process loads the program a
    first one compiled: count_compiles counts it all the same (the test suite itself
    runs with that cache)."""
    script = (
        "import jax, jax.numpy as jnp, meshkit\n"
        "hits = []\n"
        "jax.monitoring.register_event_listener(\n"
        "    lambda event, **_: hits.append(event) if event.endswith('cache_hits') else None)\n"
        "def doubled_sum(x):\n"
        "    return 2 * jnp.sum(x)\n"
        "with meshkit.count_compiles() as log:\n"
        "    jax.jit(doubled_sum)(jnp.ones(5))\n"
        "print(log.count('doubled_sum'), len(hits))\n"
    )
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    counts = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        counts.append(tuple(int(word) for word in out.stdout.split()[-2:]))
    (first, first_hits), (second, second_hits) = counts
    assert first_hits == 0 and second_hits >= 1  # compiled, then loaded from the cache
    assert first == second == 1  # one compilation each
