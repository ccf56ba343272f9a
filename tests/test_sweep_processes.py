"""The sweep recipe on 2 processes × 4 devices ranks the same trials as on 1 × 8 (a
killed sweep resuming to the same table is tested in one process, in test_sweep.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

ARGS = ["-m", "recipes.sweep", "--no-progress", "--pbt", "--steps", "12"]


def test_pbt_sweep_on_two_processes_ends_with_the_same_table(tmp_path: Path):
    command = [sys.executable, *ARGS, "--workdir", str(tmp_path / "one")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    one = json.loads(out.stdout.strip().splitlines()[-1])
    run_processes(
        [*ARGS, "--workdir", str(tmp_path / "two")], log_dir=tmp_path / "logs", timeout=300
    )
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["processes"] == 1 and two["processes"] == 2
    assert one["train_step_compiles"] == two["train_step_compiles"] == 1
    assert one["trials"] == two["trials"] > 16  # the bottom quarter was replaced twice
    assert "written: " in out.stdout and "(every trial, its scores and lineage)" in out.stdout
    trials = [
        json.loads((tmp_path / run / "results.json").read_text())["trials"]
        for run in ("one", "two")
    ]
    for mine, theirs in zip(*trials, strict=True):
        for key in ("trial", "status", "hyperparameters", "parent"):
            assert mine[key] == theirs[key], key  # the same trials, values, lineage and order
        np.testing.assert_allclose(mine["score"], theirs["score"], rtol=1e-6)
    assert any(trial["parent"] is not None for trial in trials[1])
    assert (tmp_path / "two" / "sweep.png").stat().st_size > 10_000
    assert (tmp_path / "two" / "best" / "hyperparameters.json").exists()
