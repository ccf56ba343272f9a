"""meshkit.train in one process: state, step, fit, checkpoints, FSDP, NNX, NaN handling.

The fit loop is the same program at any device count (one test checks that one device
and eight reach the same parameters): most tests run once, in the 1-device pass.
"""

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
from meshkit.models import NormCNN

BATCH = 64


def setup(mesh, *, rules=None, model=None, seed=0):
    """NormCNN (batch norm + dropout) on the 8×8 digits: the train state of the talk
    "JAX — now and future"."""
    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(
        data.digits("train"), global_batch_size=BATCH, sharding=sharding, seed=seed
    )
    model = model or train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(
        model, optax.sgd(0.05, momentum=0.9), mesh, rules=rules, seed=seed
    )
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    return state, step, pipeline


def run_steps(mesh, steps, **kwargs):
    state, step, pipeline = setup(mesh, **kwargs)
    losses = []
    with data.GlobalBatchIterator(pipeline) as batches:
        for _ in range(steps):
            state, metrics = step(state, next(batches))
            losses.append(float(metrics["loss"]))  # one step at a time: no queue of collectives
    return state, losses


@pytest.mark.once
def test_loss_decreases_and_batch_stats_update():
    mesh = meshkit.make_mesh("data=-1")
    initial, _, _ = setup(mesh)
    initial_stats = meshkit.to_host(initial.collections["batch_stats"])
    state, losses = run_steps(mesh, 40)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    stats = meshkit.to_host(state.collections["batch_stats"])
    assert not np.allclose(stats["BatchNorm_0"]["mean"], initial_stats["BatchNorm_0"]["mean"])
    assert int(state.step) == 40


@pytest.mark.once
def test_apply_model_updates_collections_in_training_mode_only():
    state, _, _ = setup(meshkit.make_mesh("data=-1"))
    images = jnp.asarray(data.digits("train").getitems(np.arange(16))["image"])
    logits, collections = train.apply_model(state, images, rng=jax.random.key(0))
    before = meshkit.to_host(state.collections)
    after = meshkit.to_host(collections)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    assert not np.allclose(after["batch_stats"]["BatchNorm_0"]["mean"], 0)
    assert logits.shape == (16, 10)
    inference, unchanged = train.apply_model(state, images)
    assert unchanged == {}
    expected = state.apply_fn(state.variables(), images, train=False)
    np.testing.assert_allclose(np.asarray(inference), np.asarray(expected), rtol=1e-6)


@pytest.mark.devices(8)
def test_one_device_and_eight_devices_reach_the_same_params():
    one, losses_one = run_steps(meshkit.make_mesh("data=1", devices=jax.devices()[:1]), 10)
    eight, losses_eight = run_steps(meshkit.make_mesh("data=-1"), 10)
    np.testing.assert_allclose(losses_one, losses_eight, rtol=2e-5)
    for a, b in zip(
        jax.tree.leaves(meshkit.to_host(one.params)),
        jax.tree.leaves(meshkit.to_host(eight.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.devices(8)
def test_fsdp_shards_params_and_trains_like_replicated():
    mesh = meshkit.make_mesh("data=-1")
    rules = meshkit.PartitionRules.fsdp("data", min_size=1024)
    fsdp, losses_fsdp = run_steps(mesh, 10, rules=rules)
    report = meshkit.describe(fsdp.params)
    kernel_line = next(line for line in report.splitlines() if line.startswith("Dense_0/kernel"))
    assert "P('data')" in kernel_line  # (256, 64): 256 rows split over 8 devices
    assert fsdp.params["Dense_0"]["kernel"].addressable_shards[0].data.shape == (32, 64)
    momentum = fsdp.opt_state[0].trace["Dense_0"]["kernel"]
    assert momentum.sharding.spec == fsdp.params["Dense_0"]["kernel"].sharding.spec
    _, losses_replicated = run_steps(mesh, 10)
    np.testing.assert_allclose(losses_fsdp, losses_replicated, rtol=2e-5)


@pytest.mark.once
def test_nnx_model_trains_through_the_same_api():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(64, 32, rngs=rngs)
            self.norm = nnx.BatchNorm(32, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.norm(self.hidden(x.reshape(x.shape[0], -1))))
            return self.out(self.dropout(h))

    mesh = meshkit.make_mesh("data=-1")
    model = train.nnx_model(MLP)
    initial = meshkit.to_host(setup(mesh, model=model)[0].collections)
    state, losses = run_steps(mesh, 30, model=model)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert state.params["hidden"]["kernel"].get_value().shape == (64, 32)
    final = meshkit.to_host(state.collections)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(final), strict=True)
    ]
    assert any(moved)  # batch statistics and the dropout stream's counter advanced


def fit(
    mesh, workdir, num_steps, eval_every=None, per_example_fn=train.classification_metrics, **kwargs
):
    state, step, pipeline = setup(mesh)
    evaluation = data.EvalPipeline(
        data.digits("test"), global_batch_size=BATCH, sharding=meshkit.batch_sharding(mesh)
    )
    return train.fit(
        state,
        step,
        pipeline,
        num_steps=num_steps,
        workdir=workdir,
        evaluation=train.Evaluation(evaluation, every=eval_every, per_example_fn=per_example_fn),
        checkpoints=train.Checkpoints(every=10, keep=2),
        logging=train.Logging(every=5, progress=False),
        **kwargs,
    )


@pytest.mark.once(8)
def test_fit_logs_checkpoints_evaluates_and_compiles_once(tmp_path):
    result = fit(meshkit.make_mesh("data=-1"), tmp_path, 25, eval_every=20)
    assert result.step == 25 and not result.preempted and result.resumed_from is None
    assert result.train_step_compiles == 1
    assert result.eval_metrics["count"] == 360 and result.eval_metrics["accuracy"] > 0.5
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [5, 10, 15, 20, 25]
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [20, 25]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [20, 25]


@pytest.mark.once  # the same at any device count
def test_a_resumed_run_logs_each_step_once(tmp_path):
    import shutil

    mesh = meshkit.make_mesh("data=-1")
    fit(mesh, tmp_path, 25)
    shutil.rmtree(tmp_path / "checkpoints" / "25")  # killed after logging 25, saved at 20
    with (tmp_path / "metrics.jsonl").open("a") as log:
        log.write('{"step": 27, "lo')  # and cut short while writing a line
    assert fit(mesh, tmp_path, 30).resumed_from == 20
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [5, 10, 15, 20, 25, 30]
    assert [line["step"] for line in lines if "eval/accuracy" in line] == [30]


@pytest.mark.devices(8)
def test_resume_onto_a_different_mesh_continues_the_run(tmp_path):
    straight = fit(meshkit.make_mesh("data=-1"), tmp_path / "straight", 30)
    fit(meshkit.make_mesh("data=-1"), tmp_path / "split", 20)
    resumed = fit(meshkit.make_mesh("data=4,model=2"), tmp_path / "split", 30)
    assert resumed.resumed_from == 20 and resumed.step == 30
    for a, b in zip(
        jax.tree.leaves(meshkit.to_host(straight.state.params)),
        jax.tree.leaves(meshkit.to_host(resumed.state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.once
def test_resuming_another_model_names_the_leaves_that_differ(tmp_path):

    class Linear(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    fit(meshkit.make_mesh("data=-1"), tmp_path, 10)
    mesh = meshkit.make_mesh("data=-1")
    state, step, pipeline = setup(mesh, model=train.linen_model(Linear(), jnp.zeros((1, 8, 8, 1))))
    with pytest.raises(
        ValueError, match=r"step 10 .* holds a different model: .*saved .*now"
    ) as info:
        train.fit(
            state, step, pipeline, num_steps=20, workdir=tmp_path,
            checkpoints=train.Checkpoints(every=10), logging=train.Logging(progress=False),
        )  # fmt: skip
    assert info.value.__suppress_context__  # Orbax's structure error is not printed above it


@pytest.mark.once
def test_resuming_with_another_precision_says_so_in_one_line(tmp_path):
    fit(meshkit.make_mesh("data=-1"), tmp_path, 10)
    mesh = meshkit.make_mesh("data=-1")
    _, step, pipeline = setup(mesh)
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(model, optax.sgd(0.05, momentum=0.9), mesh, precision="f16")
    with pytest.raises(ValueError) as info:
        train.fit(
            state, step, pipeline, num_steps=20, workdir=tmp_path,
            checkpoints=train.Checkpoints(every=10), logging=train.Logging(progress=False),
        )  # fmt: skip
    assert str(info.value) == (
        f"The checkpoint at step 10 in {tmp_path / 'checkpoints'} holds the same model with "
        "another precision: this state has a float16 loss scale (precision='f16') and the "
        "checkpoint has none. Resume with the precision it was saved with (f32 or bf16), "
        "or start in a new workdir."
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.once
def test_fit_refuses_a_batch_level_eval_value(tmp_path):
    with pytest.raises(ValueError, match=r"returned 'm' with shape \(\), but per-example"):
        fit(
            meshkit.make_mesh("data=-1"), tmp_path, 10,
            per_example_fn=lambda state, batch: {"m": jnp.mean(batch["image"])},
        )  # fmt: skip


def poisoned_setup(bad):
    """``setup`` with a loss that is NaN at the steps where ``bad(state.step)`` holds."""

    def poisoned(params, state, batch, rng):
        loss, out = train.classification_loss(params, state, batch, rng)
        return jnp.where(bad(state.step), jnp.nan, loss), out

    mesh = meshkit.make_mesh("data=-1")
    state, _, pipeline = setup(mesh)
    step = train.make_train_step(
        poisoned, train.state_shardings_of(state), meshkit.batch_sharding(mesh)
    )
    return state, step, pipeline


@pytest.mark.once
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    state, step, pipeline = poisoned_setup(lambda step: step >= 14)  # step 15 on
    with pytest.raises(train.NonFiniteLossError) as info:
        train.fit(
            state,
            step,
            pipeline,
            num_steps=40,
            workdir=tmp_path,
            checkpoints=train.Checkpoints(every=10),
            logging=train.Logging(progress=False),
        )
    message = str(info.value)
    assert "step 15" in message and "'loss': nan" in message and "step 10 in" in message
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [10]


@pytest.mark.once  # the same at any device count
def test_fit_logs_the_mean_of_each_interval_of_steps(tmp_path):
    """Metrics are summed on the device; each line is the mean of its steps' values."""
    mesh = meshkit.make_mesh("data=-1")
    _, reference = run_steps(mesh, 20)  # one step at a time, every loss read on the host
    lines = {}
    for depth in (1, 4):
        result = fit(mesh, tmp_path / str(depth), 20, dispatch=train.Dispatch(max_in_flight=depth))
        assert result.max_in_flight == depth
        logged = [json.loads(line) for line in (tmp_path / str(depth) / "metrics.jsonl").open()]
        lines[depth] = [(line["step"], line["loss"]) for line in logged if "loss" in line]
    expected = [(end, np.mean(reference[end - 5 : end])) for end in (5, 10, 15, 20)]
    for depth in (1, 4):
        assert [step for step, _ in lines[depth]] == [5, 10, 15, 20]
        np.testing.assert_allclose(
            [loss for _, loss in lines[depth]], [m for _, m in expected], rtol=1e-5
        )
    assert result.train_metrics["loss"] == lines[4][-1][1]


@pytest.mark.once
def test_a_second_fit_with_the_same_step_compiles_nothing(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    state, step, pipeline = setup(mesh)
    quiet = train.Logging(progress=False)
    first = train.fit(state, step, pipeline, num_steps=5, workdir=tmp_path, logging=quiet)
    resumed = train.fit(first.state, step, pipeline, num_steps=10, workdir=tmp_path, logging=quiet)
    assert (first.train_step_compiles, resumed.train_step_compiles) == (1, 0)
    assert resumed.resumed_from == 5 and resumed.step == 10


@pytest.mark.once
def test_a_second_create_train_state_compiles_nothing_and_seeds_still_differ():
    mesh = meshkit.make_mesh("data=-1")
    model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
    tx = optax.adam(1e-3)
    train.create_train_state(model, tx, mesh, seed=0)
    with meshkit.count_compiles() as compiles:
        again = train.create_train_state(model, tx, mesh, seed=0)
        other = train.create_train_state(model, tx, mesh, seed=1)
    assert compiles.count() == 0
    # the same values as a state initialised from its own key, outside any jit
    eager = train.parts.init_state_from_key(model, tx, jax.random.key(1))
    np.testing.assert_array_equal(other.params["kernel"], eager.params["kernel"])
    assert not np.array_equal(again.params["kernel"], other.params["kernel"])


@pytest.mark.once
@pytest.mark.parametrize("checkpoint_every", [3, 10])
def test_no_checkpoint_follows_a_non_finite_step_between_log_lines(tmp_path, checkpoint_every):
    """Step 15 goes bad inside the interval 11-20: found before any later save."""

    state, step, pipeline = poisoned_setup(lambda step: step == 14)  # the 15th step only
    with pytest.raises(train.NonFiniteLossError, match="at step 15") as info:
        train.fit(
            state,
            step,
            pipeline,
            num_steps=40,
            workdir=tmp_path,
            checkpoints=train.Checkpoints(every=checkpoint_every),
            logging=train.Logging(every=10, progress=False),
            dispatch=train.Dispatch(max_in_flight=4),
        )
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert saved[-1] < 15 and f"step {saved[-1]} in" in str(info.value)


@pytest.mark.once
def test_fit_explains_a_step_without_a_loss_and_a_bad_queue_depth(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    state, step, pipeline = setup(mesh)

    @jax.jit
    def no_loss(state, batch):
        state, metrics = step(state, batch)
        return state, {"accuracy": metrics["accuracy"]}

    with pytest.raises(ValueError, match=r"reports metrics \['accuracy'\].*metrics\['loss'\]"):
        train.fit(
            state, no_loss, pipeline, num_steps=2, workdir=tmp_path,
            logging=train.Logging(progress=False),
        )  # fmt: skip
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1 step, got 0"):
        train.Dispatch(max_in_flight=0)


@pytest.mark.once  # the same at any device count
def test_a_label_outside_the_classes_is_named_with_its_row_and_example(tmp_path):
    """A source that does not know its class count lets label 12 through to a 10-class
    model: the step's loss is NaN, and fit's error names the label and where it is."""
    digits = data.digits("train")
    arrays = {key: np.array(value) for key, value in digits.arrays.items()}
    mesh = meshkit.make_mesh("data=-1")
    probe = data.TrainPipeline(
        data.ArraySource(arrays), global_batch_size=BATCH, sharding=meshkit.batch_sharding(mesh)
    )
    index = int(probe.global_indices(2)[5])  # read by the third step, at row 5
    arrays["label"][index] = 12
    state, step, _ = setup(mesh)
    pipeline = data.TrainPipeline(
        data.ArraySource(arrays), global_batch_size=BATCH, sharding=meshkit.batch_sharding(mesh)
    )
    with pytest.raises(train.NonFiniteLossError) as info:
        train.fit(
            state,
            step,
            pipeline,
            num_steps=4,
            workdir=tmp_path,
            logging=train.Logging(progress=False),
        )
    message = str(info.value)
    assert message.startswith("Training stopped at step 3:"), message
    assert (
        "The batch of that step holds labels outside [0, 10), the model's classes: 1 of "
        f"this process's {BATCH} rows. The first is label 12 at row 5 of the global batch, "
        f"source index {index} of ArraySource." in message
    ), message
    assert "Lower the learning rate" not in message


class _Flat(nn.Module):
    """No batch statistics, no dropout: both reductions compute the same sums."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


@pytest.mark.devices(8)
def test_the_ordered_reduction_takes_the_same_steps_as_the_all_reduce():
    mesh = meshkit.make_mesh("data=-1")
    model = train.linen_model(_Flat(), jnp.zeros((1, 8, 8, 1)))
    params = {}
    for reduction in ("all_reduce", "ordered"):
        state, _, pipeline = setup(mesh, model=model)
        step = train.make_train_step(
            train.classification_loss,
            train.state_shardings_of(state),
            meshkit.batch_sharding(mesh),
            reduction=reduction,
        )
        with data.GlobalBatchIterator(pipeline) as batches:
            for _ in range(5):
                state, _ = step(state, next(batches))
        params[reduction] = jax.tree.leaves(meshkit.to_host(state.params))
    for a, b in zip(params["all_reduce"], params["ordered"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(8)
def test_the_ordered_reduction_refuses_sharded_parameters_and_unknown_names():
    mesh = meshkit.make_mesh("data=-1")
    state, _, _ = setup(mesh, rules=meshkit.PartitionRules.fsdp("data", min_size=1024))
    sharding = meshkit.batch_sharding(mesh)
    shardings = train.state_shardings_of(state)
    with pytest.raises(ValueError, match=r'reduction="ordered" gathers .* these are sharded: '):
        train.make_train_step(train.classification_loss, shardings, sharding, reduction="ordered")
    with pytest.raises(ValueError, match=r"reduction='sorted' is not one of"):
        train.make_train_step(train.classification_loss, shardings, sharding, reduction="sorted")  # pyright: ignore[reportArgumentType]
