"""The sweep recipe killed and resumed, and on 2 processes × 4 devices, ranks the same trials
as uninterrupted on 1 × 8."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshkit.testing import run_processes

pytestmark = pytest.mark.multiprocess

ARGS = ["-m", "recipes.sweep", "--no-progress", "--pbt", "--steps", "12"]


def killed_once(command: list[str], marker: Path) -> None:
    """Starts ``command`` and kills it (SIGKILL) as soon as ``marker`` exists."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the sweep never reached its second stage"
    finally:
        process.kill()
        process.wait()


def test_pbt_sweep_killed_and_on_two_processes_ends_with_the_same_table(tmp_path: Path):
    command = [sys.executable, *ARGS, "--workdir", str(tmp_path / "one")]
    # kill -9 in the second stage (after the first PBT decision), then rerun: it resumes.
    killed_once(command, tmp_path / "one" / "stage_1" / "metrics.jsonl")
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
    for mine, theirs in zip(one["table"], two["table"], strict=True):
        accuracy = mine.pop("accuracy"), theirs.pop("accuracy")
        assert mine == theirs  # the same trials, hyperparameters and order
        np.testing.assert_allclose(*accuracy, rtol=1e-6)
    results = json.loads((tmp_path / "two" / "results.json").read_text())
    assert any(trial["parent"] is not None for trial in results["trials"])
    assert (tmp_path / "two" / "sweep.png").stat().st_size > 10_000
    assert (tmp_path / "two" / "best" / "hyperparameters.json").exists()
