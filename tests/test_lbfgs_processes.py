"""meshkit.lbfgs on 2 processes × 4 devices equals 1 process × 8 devices.

The child function runs in every process (``run_processes`` imports this module
there): each process passes the same full host data, ``shard_dataset`` builds only its
own shards, and the solve is one program across both processes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sklearn import datasets

import meshkit
from meshkit import lbfgs
from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

ROWS, FEATURES, CLASSES = 3001, 32, 10  # 3,001 rows: padded to 3,008 on 8 devices


def child_solve() -> dict:
    x, y = datasets.make_classification(
        n_samples=ROWS, n_features=FEATURES, n_classes=CLASSES, n_informative=24, random_state=0
    )
    mesh = meshkit.make_mesh("data=-1")
    data = lbfgs.classification_data(x, y, mesh)
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=1e-4, l2_mask=lbfgs.l2_except("b"))
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    solution = solver.solve(start, data, 1e-3)
    grid = solver.solve_many(start, data, [1e-3, 1e-2])
    return {
        "devices": (jax.process_count(), jax.device_count(), data.padded_rows),
        "params": meshkit.to_host(solution.params),
        "value": float(solution.value),
        "iterations": int(solution.iterations),
        "status": solution.status.name,
        "history": solution.history(),
        "grid_values": meshkit.to_host(grid.value),
    }


def test_two_processes_agree_with_one_process_of_eight_devices():
    two = run_processes(child_solve, timeout=300)
    if (jax.process_count(), jax.device_count()) == (1, 8):  # this process is a 1 × 8
        one = child_solve()
    else:
        one = run_processes(child_solve, num_processes=1, devices_per_process=8, timeout=300)[0]
    assert [r["devices"] for r in two] == [(2, 8, 3008)] * 2 and one["devices"] == (1, 8, 3008)
    # the two processes hold replicas of one result: identical to the bit
    for key in ("value", "iterations", "status"):
        assert two[0][key] == two[1][key], key
    np.testing.assert_array_equal(two[0]["params"]["w"], two[1]["params"]["w"])
    # and agree with one process of 8 devices to float precision
    ours, reference = two[0], one
    assert ours["status"] == reference["status"] == "GRADIENT_TOLERANCE"
    np.testing.assert_allclose(ours["value"], reference["value"], rtol=1e-6)
    np.testing.assert_allclose(ours["params"]["w"], reference["params"]["w"], atol=2e-3)
    np.testing.assert_allclose(ours["grid_values"], reference["grid_values"], rtol=1e-6)
    np.testing.assert_allclose(ours["grid_values"][0], ours["value"], rtol=1e-5)
    n = min(len(ours["history"]["value"]), len(reference["history"]["value"]), 10)
    np.testing.assert_allclose(
        ours["history"]["value"][:n], reference["history"]["value"][:n], rtol=1e-5
    )
