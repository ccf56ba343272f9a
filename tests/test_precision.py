"""Mixed precision and gradient accumulation in the train step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import data, train
from meshkit.models import NormCNN
from meshkit.train._gradients import unrolls_microbatches

# the 8-device pass is the one that splits micro-batches over several devices
pytestmark = pytest.mark.once

BATCH = 64


class NormMLP(nn.Module):
    """Batch norm without convolutions (which XLA's CPU backend runs slowly in a loop)."""

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        x = nn.Dense(32)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(10)(nn.relu(x))


class MLP(nn.Module):
    """No batch norm, no dropout: accumulated and whole-batch gradients agree exactly."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def build(
    mesh,
    *,
    precision: str | train.Precision = "f32",
    microbatches=1,
    module=None,
    learning_rate=0.1,
):
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(module or MLP(), jnp.zeros((1, 8, 8, 1)))
    tx = optax.sgd(learning_rate, momentum=0.9)
    state = train.create_train_state(model, tx, mesh, precision=precision)
    step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(state),
        sharding,
        microbatches=microbatches,
    )
    pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=BATCH, sharding=sharding)
    return state, step, pipeline


def run(mesh, steps, **kwargs):
    state, step, pipeline = build(mesh, **kwargs)
    history = []
    with data.GlobalBatchIterator(pipeline) as batches:
        for _ in range(steps):
            state, metrics = step(state, next(batches))
            history.append(meshkit.to_host(metrics))  # one step at a time: no queued collectives
    return state, history


def test_four_micro_batches_equal_one_step_on_the_whole_batch():
    mesh = meshkit.make_mesh("data=-1")
    whole, whole_metrics = run(mesh, 3)
    split, split_metrics = run(mesh, 3, microbatches=4)
    for a, b in zip(
        jax.tree.leaves(meshkit.to_host(whole.params)),
        jax.tree.leaves(meshkit.to_host(split.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    for a, b in zip(whole_metrics, split_metrics, strict=True):
        assert a.keys() == b.keys() == {"loss", "grad_norm", "accuracy"}
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=2e-5)
    assert int(split.step) == 3  # one optimizer update per step, whatever the micro-batches


def test_micro_batches_as_one_loop_and_unrolled_give_the_same_step():
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    state, _, pipeline = build(mesh, module=NormMLP(), learning_rate=0.05)
    with data.GlobalBatchIterator(pipeline) as batches:
        batch = next(batches)
    results = []
    for unroll in (False, True):  # GPU/TPU's choice, CPU's choice

        def step_fn(state, batch, unroll=unroll):
            grads = train.parts.gradients(
                train.classification_loss,
                state,
                batch,
                state.step_rng(),
                microbatches=4,
                batch_sharding=sharding,
                unroll=unroll,
            )
            return train.parts.apply_update(state, grads)

        results.append(meshkit.to_host(jax.jit(step_fn)(state, batch)))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert unrolls_microbatches("cpu") and not unrolls_microbatches("gpu")


def test_micro_batches_carry_batch_statistics_from_one_to_the_next():
    mesh = meshkit.make_mesh("data=-1")
    state, history = run(mesh, 2, microbatches=2, module=NormCNN(), learning_rate=0.05)
    stats = meshkit.to_host(state.collections["batch_stats"]["BatchNorm_0"])
    assert stats["mean"].dtype == np.float32 and np.abs(stats["mean"]).max() > 0
    assert all(np.isfinite(m["loss"]) for m in history)


def test_a_batch_that_does_not_split_evenly_is_refused_with_the_sizes(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    state, step, pipeline = build(mesh, microbatches=3)
    with data.GlobalBatchIterator(pipeline) as batches, pytest.raises(ValueError) as error:
        step(state, next(batches))
    message = str(error.value)
    assert "64 rows" in message and "microbatches=3" in message
    assert f"multiple of 3 × {jax.device_count()}" in message
    with meshkit.count_compiles() as log, pytest.raises(ValueError) as refused:
        train.fit(state, step, pipeline, num_steps=5, workdir=str(tmp_path))  # checks first
    assert str(refused.value).startswith("The pipeline's global batch has 64 rows, which do")
    assert log.count("train_step") == 0


def test_bf16_computes_in_bf16_keeps_float32_state_and_learns_like_float32():
    mesh = meshkit.make_mesh("data=-1")
    state, step, pipeline = build(mesh, precision="bf16")
    with data.GlobalBatchIterator(pipeline) as batches:
        batch = next(batches)
        hlo = step.lower(state, batch).as_text()  # pyright: ignore[reportFunctionMemberAccess]
    operands = [
        line.split(" : (")[1].split(") ->")[0]
        for line in hlo.splitlines()
        if "stablehlo.dot_general" in line
    ]
    assert len(operands) == 5, operands  # 2 forward, 3 backward: every one in bfloat16
    assert all("f32" not in types and types.count("bf16") == 2 for types in operands), operands
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, state.opt_state))} == {
        np.dtype(np.float32)
    }
    accuracy = {}
    for precision in ("f32", "bf16"):
        trained, history = run(mesh, 60, precision=precision)
        assert {leaf.dtype for leaf in jax.tree.leaves(trained.params)} == {np.dtype("float32")}
        accuracy[precision] = np.mean([m["accuracy"] for m in history[-10:]])
    assert accuracy["f32"] > 0.9
    assert abs(accuracy["bf16"] - accuracy["f32"]) < 0.03, accuracy


def test_float16_overflow_skips_the_step_halves_the_scale_and_recovers():
    mesh = meshkit.make_mesh("data=-1")
    policy = train.Precision("f16", initial_loss_scale=2.0**26, growth_interval=1000)
    initial, _, _ = build(mesh, precision=policy)
    start = meshkit.to_host(initial.params)
    state, history = run(mesh, 30, precision=policy)
    skipped = [m["skipped"] for m in history]
    scales = [m["loss_scale"] for m in history]
    first_update = skipped.index(0.0)
    # 2**26 times the loss's gradient overflows float16's 65504: steps are skipped,
    # each halving the scale, until the scaled backward pass fits.
    assert 1 <= first_update <= 12 and all(s == 1.0 for s in skipped[:first_update])
    assert scales[: first_update + 1] == [2.0**26 / 2**i for i in range(first_update + 1)]
    assert all(m["grad_norm"] == 0.0 for m in history[:first_update])
    for i in range(len(history) - 1):  # every skip halves the scale, nothing else moves it
        assert scales[i + 1] == scales[i] / (2 if skipped[i] else 1)
    assert sum(skipped[first_update:]) <= 2  # once the scale fits, overflows are rare
    assert np.mean([m["loss"] for m in history[-5:]]) < 0.5 * history[first_update]["loss"]
    assert int(state.step) == 30
    assert float(state.loss_scale.scale)  # pyright: ignore[reportOptionalMemberAccess] == scales[-1]
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), meshkit.to_host(state.params), start)
    assert min(jax.tree.leaves(moved)) > 0


def test_a_skipped_step_leaves_parameters_and_optimizer_state_unchanged():
    mesh = meshkit.make_mesh("data=-1")
    policy = train.Precision("f16", initial_loss_scale=2.0**40)
    state, step, pipeline = build(mesh, precision=policy)
    before = meshkit.to_host((state.params, state.opt_state))
    with data.GlobalBatchIterator(pipeline) as batches:
        state, metrics = step(state, next(batches))
    after = meshkit.to_host((state.params, state.opt_state))
    assert float(metrics["skipped"]) == 1.0 and np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(state.loss_scale.scale)  # pyright: ignore[reportOptionalMemberAccess] == 2.0**39 and int(state.step) == 1


def test_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(
        ValueError, match=r"precision must be one of \['bf16', 'f16', 'f32'\].*'fp8'"
    ):
        train.Precision("fp8")  # pyright: ignore[reportArgumentType]


def test_ensemble_members_compute_in_bf16():
    from meshkit import ensemble

    layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 2)
    model = train.linen_model(MLP(), jnp.zeros((1, 8, 8, 1)))
    tx = optax.sgd(0.1)
    state = ensemble.create_ensemble_state(model, tx, layout, precision="bf16")
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    batch = meshkit.shard_batch(
        data.digits("train").getitems(np.arange(BATCH)), layout.batch_sharding
    )
    hlo = step.lower(state, batch).as_text()  # pyright: ignore[reportFunctionMemberAccess]
    assert "xbf16>" in hlo.split("stablehlo.dot_general", 1)[1].splitlines()[0]
    state, metrics = step(state, batch)
    assert state.precision.name == "bf16" and np.isfinite(float(metrics["loss"]))
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {np.dtype("float32")}


def test_steps_skipped_at_every_scale_stop_the_run_with_the_cause(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    policy = train.Precision("f16", initial_loss_scale=2.0**4)
    state, _, pipeline = build(mesh, precision=policy)

    def root_at_zero(params, state, batch, rng):  # finite loss, gradients inf * 0 = NaN
        loss, output = train.classification_loss(params, state, batch, rng)
        kernel = params["Dense_0"]["kernel"]
        return loss + jnp.sum(jnp.sqrt(jnp.abs(kernel - jax.lax.stop_gradient(kernel)))), output

    step = train.make_train_step(
        root_at_zero, train.state_shardings_of(state), meshkit.batch_sharding(mesh)
    )
    with pytest.raises(train.NonFiniteLossError) as info:
        train.fit(
            state,
            step,
            pipeline,
            num_steps=300,
            workdir=str(tmp_path),
            logging=train.Logging(every=25, progress=False),
            checkpoints=train.Checkpoints(every=50),
        )
    message = str(info.value)
    assert message.startswith(
        "Training stopped at step 100: the last 100 steps (from step 1) were all skipped "
        "because their float16 gradients overflowed"
    )
    assert "have not changed since step 0" in message and "precision='bf16'" in message
    # Checked before the step-100 checkpoint: the newest is the one before.
    assert f"The newest checkpoint is step 50 in {tmp_path / 'checkpoints'}" in message
