"""PreemptionWatcher in one process: SIGTERM and the first Ctrl-C save; a second Ctrl-C stops."""

from __future__ import annotations

import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import data, train

pytestmark = pytest.mark.once  # signal handling: no devices involved


def interrupt() -> None:
    """A Ctrl-C: SIGINT to this process, handled before the next line runs."""
    os.kill(os.getpid(), signal.SIGINT)


def test_the_first_ctrl_c_is_a_preemption_and_the_second_interrupts():
    watcher = train.PreemptionWatcher()
    try:
        assert not watcher.reached(1)
        interrupt()
        assert watcher.reached(2)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            interrupt()
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_is_a_preemption_and_close_restores_both_handlers():
    term = signal.getsignal(signal.SIGTERM)
    watcher = train.PreemptionWatcher()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.reached(1)
    watcher.close()
    assert signal.getsignal(signal.SIGTERM) == term
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_handler_of_the_programs_own_is_left_alone():
    def own(signum, frame):
        del signum, frame

    previous = signal.signal(signal.SIGINT, own)
    try:
        watcher = train.PreemptionWatcher()
        interrupt()
        assert not watcher.reached(1)
        watcher.close()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def tiny_run():
    """A state, its jitted step and a pipeline of 256 examples: a Dense layer of 4 inputs."""
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    rng = np.random.default_rng(0)
    source = data.ArraySource(
        {"image": rng.normal(size=(256, 4)).astype(np.float32), "label": rng.integers(0, 2, 256)}
    )
    pipeline = data.TrainPipeline(source, global_batch_size=16, sharding=sharding)
    model = train.linen_model(nn.Dense(2), jnp.zeros((1, 4)))
    state = train.create_train_state(model, optax.sgd(0.1), mesh)
    jitted = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    return state, jitted, pipeline


def test_ctrl_c_during_fit_saves_at_that_step_and_returns_preempted(tmp_path, capfd):
    state, jitted, pipeline = tiny_run()
    taken = 0

    def step(state, batch):  # a plain Python step: fit calls it once per step
        nonlocal taken
        taken += 1
        if taken == 7:
            interrupt()
        return jitted(state, batch)

    result = train.fit(
        state, step, pipeline, num_steps=1000, workdir=tmp_path,
        checkpoints=train.Checkpoints(every=100), logging=train.Logging(progress=False),
    )  # fmt: skip
    assert result.preempted and result.step == taken == 7
    assert sorted(int(path.name) for path in (tmp_path / "checkpoints").iterdir()) == [7]
    assert "Ctrl-C: saving a checkpoint at the next step" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize(
    ("at", "said"),
    [
        (1, "at step 1, during the first step (which compiles the train step); there is no "
            "checkpoint yet, so a rerun starts over."),
        (7, "at step 7, without saving it; rerun the same command to resume from step 5, the "
            "newest checkpoint in {checkpoints}."),
    ],
)  # fmt: skip
def test_a_second_ctrl_c_stops_fit_at_once_in_a_few_lines(tmp_path, at, said):
    state, jitted, pipeline = tiny_run()
    taken = 0

    def step(state, batch):
        nonlocal taken
        taken += 1
        if taken == at:
            interrupt()
            interrupt()  # raised here, or in JAX's compiler for a real model
        return jitted(state, batch)

    with pytest.raises(KeyboardInterrupt) as info:
        train.fit(
            state, step, pipeline, num_steps=1000, workdir=tmp_path,
            checkpoints=train.Checkpoints(every=5), logging=train.Logging(progress=False),
        )  # fmt: skip
    checkpoints = tmp_path / "checkpoints"
    assert str(info.value) == "A second Ctrl-C stopped training " + said.format(
        checkpoints=checkpoints
    )
    assert info.value.__suppress_context__  # the traceback ends in fit, not in the loop
    assert info.traceback[-1].name == "fit"
    assert sorted(int(path.name) for path in checkpoints.iterdir()) == ([5] if at > 5 else [])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_inside_a_chunk_saves_after_it_and_the_rerun_is_bit_exact(tmp_path):
    """The signal arrives while chunks of 8 steps are queued (the hook reads step 12's log
    line when its chunk leaves the queue); the run saves at the end of the chunk under
    way, between checkpoint periods, and a rerun with the same arguments ends with the
    bits of a run never interrupted."""
    _, _, host = tiny_run()
    mesh = meshkit.make_mesh("data=-1")
    pipeline = data.TrainPipeline(
        host.source,
        global_batch_size=16,
        sharding=host.sharding,
        input_settings=data.InputSettings(resident=True),
    )
    model, tx = train.linen_model(nn.Dense(2), jnp.zeros((1, 4))), optax.sgd(0.1)
    step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(train.create_train_state(model, tx, mesh)),
        host.sharding,
    )
    settings = {
        "num_steps": 64,
        "checkpoints": train.Checkpoints(every=32),
        "logging": train.Logging(every=4, progress=False),
        "dispatch": train.Dispatch(steps_per_dispatch=8),
    }

    def fit(workdir, hooks=()):
        state = train.create_train_state(model, tx, mesh)
        return train.fit(state, step, pipeline, workdir=workdir, hooks=hooks, **settings)

    def sigterm_at_step_12(boundary: train.Boundary) -> bool:
        if boundary.kind == "log" and boundary.step == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    straight = fit(tmp_path / "straight")
    stopped = fit(tmp_path / "run", hooks=[sigterm_at_step_12])
    assert stopped.preempted and stopped.step % 8 == 0 and stopped.step % 32 != 0
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved[-1] == stopped.step
    resumed = fit(tmp_path / "run")
    assert resumed.resumed_from == stopped.step and resumed.step == 64
    for got, expected in zip(
        jax.tree.leaves(meshkit.to_host(resumed.state.params)),
        jax.tree.leaves(meshkit.to_host(straight.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, expected)
