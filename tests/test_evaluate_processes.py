"""Full evaluation on 2 processes × 4 devices, with unequal per-process example counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit.evaluate import full_eval, pad_shard_unpad, stream_eval
from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

N = 4097  # the notebook's case: not a multiple of anything


def per_example(w, batch):
    return {"sq": (batch["x"] * w) ** 2, "pred": batch["x"] * w}


def child_full_eval() -> dict:
    x = np.arange(N, dtype=np.float32) / N
    mesh = meshkit.make_mesh("data=-1")
    result = full_eval(per_example, 2.0, {"x": x}, mesh=mesh, batch_size=256, collect=["pred"])
    return {
        "count": result.count,
        "steps": result.num_steps,
        "sq": result.metrics["sq"],
        "pred": result.per_example["pred"],
    }


def child_stream_eval() -> dict:
    # Each process holds its own examples: 2,500 on process 0, 1,597 on process 1.
    mine = np.arange(2500) if jax.process_index() == 0 else np.arange(2500, N)
    rows = 64

    def batches():
        for start in range(0, len(mine), rows):
            yield {"x": mine[start : start + rows].astype(np.float32)}

    result = stream_eval(
        lambda _, b: {"x": b["x"]},
        None,
        batches(),
        mesh=meshkit.make_mesh("data=-1"),
        rows_per_process=rows,
    )
    return {"count": result.count, "steps": result.num_steps, "x": result.metrics["x"]}


def child_pad_shard_unpad(min_batch: int | None) -> np.ndarray:
    rows = 5 if jax.process_index() == 0 else 11  # different on each process
    x = np.arange(rows, dtype=np.float32) + 100 * jax.process_index()
    wrapped = pad_shard_unpad(
        jax.jit(lambda w, x: x * w), meshkit.make_mesh("data=-1"), min_batch=min_batch
    )
    return wrapped(jnp.float32(2.0), x)


def test_full_eval_4097_on_two_processes():
    x = np.arange(N, dtype=np.float32) / N
    for r in run_processes(child_full_eval):
        assert r["count"] == N and r["steps"] == 17
        np.testing.assert_allclose(r["sq"], np.mean((2 * x) ** 2), rtol=1e-5)
        np.testing.assert_array_equal(r["pred"], 2 * x)  # every example, in order


def test_stream_eval_stops_together_with_unequal_counts():
    results = run_processes(child_stream_eval)
    # process 0 needs 40 batches of 64, process 1 needs 25: both run 40 + 1 steps
    assert [r["steps"] for r in results] == [41, 41]
    for r in results:
        assert r["count"] == N
        np.testing.assert_allclose(r["x"], np.mean(np.arange(N)), rtol=1e-6)


@pytest.mark.parametrize("min_batch", [None, 16])
def test_pad_shard_unpad_gives_each_process_its_rows(min_batch):
    out0, out1 = run_processes(child_pad_shard_unpad, min_batch)
    np.testing.assert_array_equal(out0, 2 * np.arange(5))
    np.testing.assert_array_equal(out1, 2 * (np.arange(11) + 100))
