"""A loop of one's own from fit's parts (InFlight, MetricSums, Checkpoints) matches fit."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import data, train

# fit against the same parts in another loop: equal on any device count
pytestmark = pytest.mark.once

BATCH = 64
STEPS = 12
LOG_EVERY = 5


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1))))


def setup():
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(MLP(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(model, optax.sgd(0.1, momentum=0.9), mesh, seed=0)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    pipeline = data.TrainPipeline(
        data.digits("train"), global_batch_size=BATCH, sharding=sharding, seed=0
    )
    return state, step, pipeline


def loop_by_hand(state, train_step, pipeline, *, num_steps, workdir, policy):
    """fit's parts in a loop of one's own; returns the state and the logged mean losses."""
    mesh = pipeline.sharding.mesh
    checkpointer = policy.checkpointer(workdir)
    window = train.parts.InFlight.for_mesh(mesh)
    logged = []

    def read(step, interval):
        if interval is not None:
            assert sums is not None
            result = sums.read(interval, step)
            assert result.first_bad_step is None
            logged.append((step, result.means["loss"]))

    with data.GlobalBatchIterator(pipeline) as batches:
        sums = interval = None
        for step in range(1, num_steps + 1):
            batch = next(batches)
            if sums is None or interval is None:
                sums, state, interval = train.parts.MetricSums.first_step(
                    train_step, state, batch, mesh=mesh
                )
            else:
                state, interval = sums.step(state, batch, interval)
            checkpointer.check(step)
            save = policy.due(step, last=step == num_steps)
            closes = save or step % LOG_EVERY == 0
            if closes:
                sums.copy_to_host_async(interval)
            for done in window.push((step, interval if closes else None), interval.steps):
                read(*done)
            if closes:
                interval = sums.zeros
            if save:
                for done in window.drain():
                    read(*done)
                checkpointer.save(step, state, batches.state(), force=True)
    checkpointer.wait()
    checkpointer.close()
    return state, logged


def test_a_hand_written_loop_of_fits_parts_matches_fit(tmp_path):
    policy = train.Checkpoints(every=10, keep=2)
    state, step, pipeline = setup()
    by_hand, logged = loop_by_hand(
        state, step, pipeline, num_steps=STEPS, workdir=tmp_path / "by_hand", policy=policy
    )
    state, step, pipeline = setup()  # a fresh state: the step donates it
    result = train.fit(
        state,
        step,
        pipeline,
        num_steps=STEPS,
        workdir=tmp_path / "fit",
        checkpoints=policy,
        logging=train.Logging(every=LOG_EVERY, progress=False),
    )
    lines = [json.loads(line) for line in (tmp_path / "fit" / "metrics.jsonl").open()]
    assert logged == [(line["step"], line["loss"]) for line in lines]
    assert [step for step, _ in logged] == [5, 10, 12]
    for a, b in zip(
        jax.tree.leaves(meshkit.to_host(by_hand.params)),
        jax.tree.leaves(meshkit.to_host(result.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)  # the same programs on the same batches
    for run in ("by_hand", "fit"):
        saved = sorted(int(p.name) for p in (tmp_path / run / "checkpoints").iterdir())
        assert saved == [10, 12]
