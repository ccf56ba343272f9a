"""Training across processes and process deaths: 1×8 vs 2×4, SIGKILL resume, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import checkpoint, data, train
from meshkit.models import NormCNN
from meshkit.testing import run_processes, start_processes

# Signals, heartbeats, stalls and timed dispatches: with no other test's processes beside them.
pytestmark = [pytest.mark.multiprocess, pytest.mark.exclusive]

RECIPE = ["-m", "recipes.data_parallel", "--model", "norm_cnn", "--no-progress"]


def train_ten_steps() -> dict:
    """Ten steps of NormCNN (batch norm, dropout) with each reduction of the gradients."""
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding)
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    results = {}
    for reduction in ("all_reduce", "ordered"):
        state = train.create_train_state(model, optax.sgd(0.05, momentum=0.9), mesh)
        step = train.make_train_step(
            train.classification_loss,
            train.state_shardings_of(state),
            sharding,
            reduction=reduction,
        )
        losses = []
        with data.GlobalBatchIterator(pipeline) as batches:
            for _ in range(10):
                state, metrics = step(state, next(batches))
                losses.append(float(metrics["loss"]))
        results[reduction] = {
            "params": meshkit.to_host(state.params),
            "batch_stats": meshkit.to_host(state.collections),
            "losses": losses,
        }
    return results


@pytest.mark.devices(8)
def test_two_processes_train_like_one_and_bit_identically_with_the_ordered_reduction():
    reference = train_ten_steps()
    for result in run_processes(train_ten_steps):
        # The compiler's all-reduce adds in another order across processes: rounding.
        mine, theirs = result["all_reduce"], reference["all_reduce"]
        np.testing.assert_allclose(mine["losses"], theirs["losses"], rtol=2e-5)
        for a, b in zip(
            jax.tree.leaves(mine["params"]), jax.tree.leaves(theirs["params"]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        # Gathered and added in device order: the same bits.
        mine, theirs = result["ordered"], reference["ordered"]
        assert mine["losses"] == theirs["losses"]
        for key in ("params", "batch_stats"):
            for a, b in zip(jax.tree.leaves(mine[key]), jax.tree.leaves(theirs[key]), strict=True):
                np.testing.assert_array_equal(a, b)


def final_params(workdir: Path) -> list[np.ndarray]:
    mesh = meshkit.make_mesh("data=-1")
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    target = train.create_train_state(model, optax.sgd(0.05, momentum=0.9), mesh)
    checkpointer = checkpoint.Checkpointer(workdir / "checkpoints", save_every=1)
    state, _ = checkpointer.restore(target)
    checkpointer.close()
    return [np.asarray(leaf) for leaf in jax.tree.leaves(meshkit.to_host(state))]


def wait_for_checkpoint(workdir: Path, step: int, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 120
    while not (workdir / "checkpoints" / str(step)).is_dir():
        assert process is None or process.poll() is None, "the run ended before its checkpoint"
        assert time.monotonic() < deadline, f"no checkpoint {step} in {workdir}"
        time.sleep(0.02)


def recipe(workdir: Path, steps: int = 400) -> list[str]:
    return [
        sys.executable,
        *RECIPE,
        "--steps",
        str(steps),
        "--checkpoint-every",
        "20",
        "--eval-every",
        "100000",
        "--workdir",
        str(workdir),
    ]


def train_losses(workdir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_sigkill_and_restart_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    subprocess.run(
        recipe(tmp_path / "straight", steps=200), check=True, capture_output=True, timeout=300
    )
    killed = subprocess.Popen(
        recipe(tmp_path / "killed", steps=200), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_checkpoint(tmp_path / "killed", 20, killed)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    restarted = subprocess.run(
        recipe(tmp_path / "killed", steps=200),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["resumed_from"] < 200
    for a, b in zip(
        final_params(tmp_path / "straight"), final_params(tmp_path / "killed"), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    assert all(resumed[step] == straight[step] for step in resumed)  # the same batches


def test_sigterm_saves_and_exits_with_the_preemption_code(tmp_path):
    run = subprocess.Popen(recipe(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_checkpoint(tmp_path, 20, run)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == train.PREEMPTED_EXIT_CODE
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] and 20 < summary["steps"] < 400
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert saved[-1] == summary["steps"]  # saved at the step boundary after the signal


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step_of_a_chunked_run(tmp_path):
    group = start_processes(
        [
            *RECIPE,
            "--steps",
            "400",
            "--checkpoint-every",
            "20",
            "--eval-every",
            "100000",
            "--steps-per-dispatch",
            "4",  # JAX's service agrees on one step, which may fall inside a dispatch
            "--workdir",
            str(tmp_path),
        ],
        log_dir=tmp_path / "logs",
    )
    try:
        wait_for_checkpoint(tmp_path, 20, group.processes[0])
        group.processes[1].send_signal(signal.SIGTERM)
        codes = group.wait(timeout=120, check=False)
    finally:
        group.kill()
    assert codes == [train.PREEMPTED_EXIT_CODE] * 2, group.log(0)[-2000:] + group.log(1)[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] and summary["processes"] == 2 and summary["steps"] < 400
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())[-1] == summary["steps"]


class _TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


def fit_auto_with_unequal_clocks(workdir: str) -> dict:
    """A 300-step resident run with ``'auto'`` whose processes' clocks disagree: process
    0's says a chunk's steps run 10 times faster than they do, process 1's 10 times
    slower, so deciding alone process 0 would choose chunks and process 1 one step per
    dispatch."""
    from meshkit.train import _loop

    timed = _loop._Loop.timed
    chunk_scale = 0.1 if jax.process_index() == 0 else 10.0

    def skewed(self, steps_per_dispatch, dispatches):
        seconds = timed(self, steps_per_dispatch, dispatches)
        if seconds is None or steps_per_dispatch == 1:
            return seconds
        return seconds * chunk_scale

    _loop._Loop.timed = skewed
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(_TinyMLP(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(model, optax.sgd(0.05, momentum=0.9), mesh, seed=0)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    pipeline = data.TrainPipeline(
        data.digits("train"),
        global_batch_size=64,
        sharding=sharding,
        input_settings=data.InputSettings(resident=True),
    )
    result = train.fit(
        state,
        step,
        pipeline,
        num_steps=300,
        workdir=workdir,
        checkpoints=train.Checkpoints(every=100),
        logging=train.Logging(every=50, progress=False),
        dispatch=train.Dispatch(steps_per_dispatch="auto"),
    )
    return {"dispatch": result.dispatch, "params": meshkit.to_host(result.state.params)}


@pytest.mark.devices(8)
def test_processes_choose_one_chunk_size_for_auto_from_the_slowest_measurement(tmp_path):
    """Chosen apart, one process's chunk program would meet another's single steps."""
    first, second = run_processes(fit_auto_with_unequal_clocks, str(tmp_path), timeout=240)
    assert first["dispatch"] == second["dispatch"]
    assert "auto:" in first["dispatch"] and " at 1 per dispatch, " in first["dispatch"]  # probed
    for a, b in zip(
        jax.tree.leaves(first["params"]), jax.tree.leaves(second["params"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "12"], "Global batch size 12 must be a positive multiple of the 8"),
        (["--model", "resnet"], "Unknown --model 'resnet'"),
        (["--dataset", "mnist", "--data-dir", "/nonexistent"], "/nonexistent does not exist."),
        (["--dataset", "mnist"], "pass --data-dir"),
        (
            ["--mesh", "data=3"],
            "--mesh data=3: Mesh axes {'data': 3} multiply to 3 devices, but 8 devices are",
        ),
        (
            ["--profile-steps", "10,5", "--steps", "5"],
            "--profile-steps 10,5 traces steps 10-14, but --steps 5 ends the run before them",
        ),
    ],
)
def test_recipe_bad_input_is_explained(args, message, tmp_path):
    out = subprocess.run(
        [sys.executable, *RECIPE, *args, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-1500:]
    assert "Traceback" not in out.stderr, out.stderr[-1500:]  # the message, no traceback
