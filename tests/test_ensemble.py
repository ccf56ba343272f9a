"""meshkit.ensemble in one process: layouts, independence, metrics, K=1, checkpoints, errors.

What members on several devices could get wrong (their independence, their shardings,
their checkpoints) runs in the 8-device pass; arithmetic and messages in the 1-device one.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import checkpoint, data, ensemble, evaluate, train
from meshkit.ensemble._metrics import member_metric_name
from meshkit.models import NormCNN

BATCH = 32


class TinyCNN(nn.Module):
    """One 3×3 convolution and a dense layer: a plain conv net that compiles in a blink."""

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = nn.relu(nn.Conv(4, (3, 3))(x_BxHxWxC))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def tiny_model(module: nn.Module | None = None) -> train.Model:
    return train.linen_model(module or TinyCNN(), jnp.zeros((1, 8, 8, 1)))


TX = optax.sgd(0.1, momentum=0.9)


def layout_for(members: int, axes: str | None = None) -> ensemble.EnsembleLayout:
    """``axes``, or as many devices on ``ensemble`` as divide K and the rest on ``data``."""
    if axes is None:
        size = math.gcd(members, jax.device_count())
        axes = f"ensemble={size},data=-1"
    return ensemble.EnsembleLayout(meshkit.make_mesh(axes), members)


def host_batches(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    source = data.digits("train")
    rng = np.random.default_rng(seed)
    rows = [rng.choice(len(source), BATCH, replace=False) for _ in range(steps)]
    return [source.getitems(r) for r in rows]


def train_ensemble(layout, batches, *, model=None, seed=0):
    state = ensemble.create_ensemble_state(model or tiny_model(), TX, layout, seed=seed)
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    metrics = []
    for batch in batches:
        state, step_metrics = step(state, meshkit.shard_batch(batch, layout.batch_sharding))
        metrics.append(meshkit.to_host(step_metrics))  # read at once: never a queue of steps
    return state, metrics


def member_params(state, index):
    return meshkit.to_host(ensemble.member_state(state, index).params)


def assert_trees_close(a, b, **tolerance):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, **tolerance)


@pytest.mark.once(8)
def test_members_differ_after_init_and_follow_their_keys():
    layout = layout_for(4)
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout, seed=7)
    kernels = meshkit.to_host(state.params["Conv_0"]["kernel"])
    assert kernels.shape == (4, 3, 3, 1, 4)
    for i in range(4):
        for j in range(i):
            assert not np.allclose(kernels[i], kernels[j])
    again = ensemble.create_ensemble_state(tiny_model(), TX, layout, seed=7)
    np.testing.assert_array_equal(kernels, meshkit.to_host(again.params["Conv_0"]["kernel"]))
    # Member 2 is initialised from fold_in(key(7), 2), as documented.
    init_key = jax.random.split(jax.random.fold_in(jax.random.key(7), 2))[0]
    alone = jax.jit(tiny_model().init)(init_key)["params"]
    assert_trees_close(member_params(state, 2), alone, rtol=1e-6, atol=1e-7)
    assert state.params["Conv_0"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("ensemble")


@pytest.mark.once(8)
def test_the_step_keeps_shapes_dtypes_shardings_and_compiles_once():
    layout = layout_for(4)
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)

    def contract(tree):
        return [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in jax.tree.leaves(tree)]

    before = contract(state)
    assert all(sharding == layout.state_sharding for _, _, sharding in before)
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    metrics = {}
    with meshkit.count_compiles() as log:
        for batch in host_batches(3):
            state, metrics = step(state, meshkit.shard_batch(batch, layout.batch_sharding))
            jax.block_until_ready(metrics)  # one step in flight at most
    assert contract(state) == before
    assert log.count("ensemble_train_step") == 1
    assert all(
        value.shape == () and value.sharding.is_fully_replicated for value in metrics.values()
    )
    assert meshkit.to_host(state.step).tolist() == [3, 3, 3, 3]


@pytest.mark.once(8)
def test_each_member_trains_as_if_alone():
    """Member i's update in the ensemble equals a plain data-parallel step on member i alone."""
    layout = layout_for(4)
    batch = host_batches(1)[0]
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    alone = [ensemble.member_state(state, i) for i in range(4)]
    sharding = meshkit.batch_sharding(layout.mesh)
    plain_step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(alone[0]), sharding
    )
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    state, metrics = step(state, meshkit.shard_batch(batch, layout.batch_sharding))
    metrics = meshkit.to_host(metrics)
    for i in range(4):
        updated, plain_metrics = plain_step(alone[i], meshkit.shard_batch(batch, sharding))
        assert_trees_close(
            member_params(state, i), meshkit.to_host(updated.params), rtol=2e-5, atol=1e-6
        )
        np.testing.assert_allclose(metrics[f"member_{i}/loss"], plain_metrics["loss"], rtol=1e-5)


@pytest.mark.once  # the same at any device count
def test_a_diverging_member_never_touches_the_others():
    layout = layout_for(4)
    batches = host_batches(3)
    clean, _ = train_ensemble(layout, batches)
    poisoned = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    # Member 1's kernel becomes NaN: its loss and gradients are NaN from the first step.
    poisoned = poisoned.replace(
        params=jax.tree.map(lambda p: p.at[1].set(jnp.nan), poisoned.params)
    )
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    for batch in batches:
        poisoned, metrics = step(poisoned, meshkit.shard_batch(batch, layout.batch_sharding))
        losses = ensemble.per_member(meshkit.to_host(metrics), "loss")
        assert np.isnan(losses[1]) and np.isfinite(np.delete(losses, 1)).all()
    for i in (0, 2, 3):
        assert_trees_close(member_params(poisoned, i), member_params(clean, i), rtol=0, atol=0)
    assert np.isnan(jax.tree.leaves(member_params(poisoned, 1))[0]).all()


@pytest.fixture(scope="module")
def eight_members_on_eight_devices():
    """K=8 on ``ensemble=8`` (the seed's layout): the reference the other layouts must match."""
    batches = host_batches(3)
    state, metrics = train_ensemble(layout_for(8, "ensemble=8"), batches)
    return batches, meshkit.to_host(state.params), metrics


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "axes", ["ensemble=4,data=2", "ensemble=2,data=4", "ensemble=1,data=8", "data=4,ensemble=2"]
)
def test_any_mesh_trains_the_same_members(axes, eight_members_on_eight_devices):
    batches, reference, reference_metrics = eight_members_on_eight_devices
    state, metrics = train_ensemble(layout_for(8, axes), batches)
    assert_trees_close(meshkit.to_host(state.params), reference, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics[-1]["loss"], reference_metrics[-1]["loss"], rtol=1e-5)


@pytest.mark.devices(8)
def test_two_members_per_device_train_like_one(eight_members_on_eight_devices):
    """K=16 on 8 devices: its first 8 members are the K=8 ensemble (members never mix)."""
    batches, reference, _ = eight_members_on_eight_devices
    sixteen, _ = train_ensemble(layout_for(16, "ensemble=8"), batches)
    first_eight = jax.tree.map(lambda leaf: leaf[:8], meshkit.to_host(sixteen.params))
    assert_trees_close(first_eight, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.once(8)
def test_k1_reproduces_plain_data_parallel_training():
    mesh = meshkit.make_mesh("ensemble=1,data=-1")
    layout = ensemble.EnsembleLayout(mesh, num_members=1)
    batches = host_batches(5)
    ensemble_state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    plain = ensemble.member_state(ensemble_state, 0)  # the same start
    sharding = meshkit.batch_sharding(mesh)
    plain_step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(plain), sharding
    )
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    for batch in batches:
        ensemble_state, metrics = step(ensemble_state, meshkit.shard_batch(batch, sharding))
        plain, plain_metrics = plain_step(plain, meshkit.shard_batch(batch, sharding))
        np.testing.assert_allclose(float(metrics["loss"]), float(plain_metrics["loss"]), rtol=1e-5)
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), float(plain_metrics["grad_norm"]), rtol=1e-4
        )
    assert_trees_close(
        member_params(ensemble_state, 0), meshkit.to_host(plain.params), rtol=1e-4, atol=1e-6
    )
    assert int(plain.step) == 5 and meshkit.to_host(ensemble_state.step).tolist() == [5]


def numpy_reference(member_logits: list[np.ndarray], labels: np.ndarray) -> dict[str, float]:
    """The ensemble's metrics from its members' logits, in float64 numpy."""
    logits_KxBxC = np.stack(member_logits).astype(np.float64)
    shifted = logits_KxBxC - logits_KxBxC.max(-1, keepdims=True)
    probs_KxBxC = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    ensemble_BxC = probs_KxBxC.mean(0)
    rows = np.arange(len(labels))
    reference = {
        "ensemble_accuracy": float(np.mean(ensemble_BxC.argmax(-1) == labels)),
        "ensemble_loss": float(np.mean(-np.log(ensemble_BxC[rows, labels]))),
    }
    for i, probs_BxC in enumerate(probs_KxBxC):
        reference[f"member_{i}/accuracy"] = float(np.mean(probs_BxC.argmax(-1) == labels))
        reference[f"member_{i}/loss"] = float(np.mean(-np.log(probs_BxC[rows, labels])))
    return reference


@pytest.mark.once  # the same at any device count
def test_ensemble_metrics_equal_a_numpy_reference_from_member_outputs():
    layout = layout_for(4)
    state, _ = train_ensemble(layout, host_batches(10))
    test = data.digits("test")
    images, labels = test.getitems(np.arange(len(test))).values()
    member_logits = []
    for i in range(4):
        member = ensemble.member_state(state, i)
        member_logits.append(np.asarray(member.apply_fn(member.variables(), images)))
    reference = numpy_reference(member_logits, labels)

    pipeline = data.EvalPipeline(test, global_batch_size=64, sharding=layout.batch_sharding)
    result = evaluate.full_eval(ensemble.ensemble_metrics(layout), state, pipeline)
    assert result.count == 360  # 5 full batches and a padded, masked one
    for name, value in reference.items():
        np.testing.assert_allclose(result.metrics[name], value, rtol=2e-5, atol=1e-6)
    accuracies = ensemble.per_member(result.metrics, "accuracy")
    np.testing.assert_allclose(result.metrics["accuracy"], accuracies.mean(), rtol=1e-6)

    # make_predict: the averaged probabilities and each member's own logits.
    inputs = meshkit.shard_batch(images[:64], layout.batch_sharding)
    probs, logits = meshkit.to_host(ensemble.make_predict(layout)(state, inputs))
    np.testing.assert_allclose(logits, np.stack(member_logits)[:, :64], rtol=1e-5, atol=1e-5)
    expected = np.mean([jax.nn.softmax(x) for x in member_logits], axis=0)[:64]
    np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.once
def test_train_step_ensemble_metrics_equal_a_numpy_reference():
    layout = layout_for(4)
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    batch = host_batches(1)[0]
    member_logits = []
    for i in range(4):  # the members before the step, on the step's batch
        member = ensemble.member_state(state, i)
        member_logits.append(np.asarray(member.apply_fn(member.variables(), batch["image"])))
    reference = numpy_reference(member_logits, batch["label"])
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    _, metrics = step(state, meshkit.shard_batch(batch, layout.batch_sharding))
    metrics = meshkit.to_host(metrics)
    for name in ("ensemble_accuracy", "ensemble_loss", "member_3/accuracy", "member_0/loss"):
        np.testing.assert_allclose(metrics[name], reference[name], rtol=1e-5, atol=1e-6)
    member_losses = [reference[f"member_{i}/loss"] for i in range(4)]
    np.testing.assert_allclose(metrics["loss"], np.mean(member_losses), rtol=1e-5)


@pytest.mark.once
def test_an_extracted_member_evaluates_like_its_column_of_the_ensemble():
    layout = layout_for(2)
    state, _ = train_ensemble(layout, host_batches(5))
    pipeline = data.EvalPipeline(
        data.digits("test"), global_batch_size=64, sharding=layout.batch_sharding
    )
    together = evaluate.full_eval(ensemble.ensemble_metrics(layout), state, pipeline).metrics
    member = ensemble.member_state(state, 1)
    assert member.step.shape == () and member.params["Dense_0"]["kernel"].shape == (64, 10)
    alone = evaluate.full_eval(train.classification_metrics, member, pipeline).metrics
    np.testing.assert_allclose(alone["accuracy"], together["member_1/accuracy"], rtol=1e-6)
    np.testing.assert_allclose(alone["loss"], together["member_1/loss"], rtol=1e-5)


@pytest.mark.once(8)
def test_members_with_batch_norm_and_dropout_keep_their_own_statistics():
    layout = layout_for(2)
    model = tiny_model(NormCNN())
    state, metrics = train_ensemble(layout, host_batches(8), model=model)
    stats = meshkit.to_host(state.collections["batch_stats"]["BatchNorm_0"]["mean"])
    assert stats.shape == (2, 16) and not np.allclose(stats[0], stats[1])
    assert np.all(np.abs(stats) > 0)  # updated from their zero initialisation
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.once
def test_member_classification_loss_is_train_classification_loss_with_logits():
    mesh = meshkit.make_mesh("data=-1")
    state = train.create_train_state(tiny_model(NormCNN()), TX, mesh)
    batch = {key: jnp.asarray(value) for key, value in host_batches(1)[0].items()}
    args = (state.params, state, batch, jax.random.key(3))
    member_loss, member_out = ensemble.classification_loss(*args)
    loss, out = train.classification_loss(*args)
    np.testing.assert_allclose(member_loss, loss, rtol=1e-6)
    assert_trees_close(member_out.metrics, out.metrics, rtol=1e-6)
    assert_trees_close(member_out.collections, out.collections, rtol=1e-6)
    assert member_out.logits is not None and member_out.logits.shape == (BATCH, 10)


@pytest.mark.once
def test_a_train_loss_reports_its_own_metrics_for_every_member():
    def margin_loss(params, state, batch, rng):
        loss, out = train.classification_loss(params, state, batch, rng)
        return loss, train.LossOutput(
            out.collections, {"margin": 2 * loss, "count": jnp.asarray(3)}
        )

    layout = layout_for(2)
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    batch = host_batches(1)[0]
    expected = [
        train.classification_loss(m.params, m, jax.tree.map(jnp.asarray, batch), m.step_rng())[0]
        for m in (ensemble.member_state(state, i) for i in range(2))
    ]
    step = ensemble.make_ensemble_step(margin_loss, layout, donate=False)
    metrics = meshkit.to_host(step(state, meshkit.shard_batch(batch, layout.batch_sharding))[1])
    assert sorted(metrics) == sorted(
        ["loss", "grad_norm"]
        + [
            member_metric_name(i, n)
            for i in range(2)
            for n in ("loss", "grad_norm", "margin", "count")
        ]
    )
    np.testing.assert_allclose(ensemble.per_member(metrics, "loss"), expected, rtol=1e-5)
    np.testing.assert_allclose(
        ensemble.per_member(metrics, "margin"), 2 * np.array(expected), rtol=1e-5
    )
    np.testing.assert_array_equal(ensemble.per_member(metrics, "count"), [3, 3])


@pytest.mark.once(8)
def test_member_batches_give_each_member_its_own_order():
    layout = layout_for(2)
    source = data.digits("train")
    pipeline = ensemble.MemberTrainPipeline(
        source, 2, global_batch_size=BATCH, sharding=layout.batch_sharding, seed=3
    )
    local = pipeline.local_batch(0)
    assert local["image"].shape == (BATCH, 2, 8, 8, 1)
    assert not np.array_equal(local["label"][:, 0], local["label"][:, 1])
    assert pipeline.state_fields()["num_members"] == 2
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    alone = [ensemble.member_state(state, i) for i in range(2)]
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout, member_batches=True)
    with data.GlobalBatchIterator(pipeline) as batches:
        state, metrics = step(state, next(batches))
    assert "ensemble_accuracy" not in metrics  # members saw different examples
    sharding = meshkit.batch_sharding(layout.mesh)
    plain_step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(alone[0]), sharding
    )
    for i in range(2):
        column = {key: value[:, i] for key, value in local.items()}
        updated, _ = plain_step(alone[i], meshkit.shard_batch(column, sharding))
        assert_trees_close(
            member_params(state, i), meshkit.to_host(updated.params), rtol=2e-5, atol=1e-6
        )


@pytest.mark.once(8)
def test_checkpoint_round_trip_restores_onto_another_layout(tmp_path):
    layout = layout_for(4)
    state, _ = train_ensemble(layout, host_batches(2))
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    checkpointer.save(2, state, {"step": 2})
    checkpointer.wait()
    other = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 4)
    target = ensemble.abstract_ensemble_state(tiny_model(), TX, other)
    restored, data_state = checkpointer.restore(target)
    checkpointer.close()
    assert data_state == {"step": 2}
    assert restored.params["Dense_0"]["kernel"].sharding == other.state_sharding
    assert_trees_close(meshkit.to_host(restored), meshkit.to_host(state), rtol=0, atol=0)


def fit_ensemble(layout, model, step, workdir, num_steps):
    pipeline = data.TrainPipeline(
        data.digits("train"), global_batch_size=BATCH, sharding=layout.batch_sharding, seed=1
    )
    evaluation = data.EvalPipeline(
        data.digits("test"), global_batch_size=64, sharding=layout.batch_sharding
    )
    return train.fit(
        ensemble.create_ensemble_state(model, TX, layout),
        step,
        pipeline,
        num_steps=num_steps,
        workdir=workdir,
        evaluation=train.Evaluation(evaluation, per_example_fn=ensemble.ensemble_metrics(layout)),
        checkpoints=train.Checkpoints(every=5),
        logging=train.Logging(progress=False),
    )


@pytest.mark.once(8)
def test_fit_trains_evaluates_and_resumes_an_ensemble_exactly(tmp_path):
    layout = layout_for(2)
    model = tiny_model()  # one apply_fn: the states' static fields match, so no recompiles
    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    straight = fit_ensemble(layout, model, step, tmp_path / "straight", 10)
    assert straight.train_step_compiles == 1
    assert straight.eval_metrics["count"] == 360
    assert {"ensemble_accuracy", "member_0/accuracy", "member_1/loss"} <= set(straight.eval_metrics)
    assert {"loss", "grad_norm", "ensemble_loss", "member_1/accuracy"} <= set(
        straight.train_metrics
    )
    assert fit_ensemble(layout, model, step, tmp_path / "split", 5).train_step_compiles == 0
    resumed = fit_ensemble(layout, model, step, tmp_path / "split", 10)
    assert resumed.resumed_from == 5 and resumed.step == 10
    assert resumed.train_step_compiles == 0  # the same step, already compiled
    for a, b in zip(
        jax.tree.leaves(meshkit.to_host(straight.state)),
        jax.tree.leaves(meshkit.to_host(resumed.state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert resumed.eval_metrics == straight.eval_metrics


@pytest.mark.once
def test_members_not_divisible_by_the_ensemble_axis_is_explained():
    mesh = meshkit.make_mesh("ensemble=-1")
    size = jax.device_count()
    if size == 1:
        pytest.skip("every K divides an ensemble axis of size 1")
    with pytest.raises(ValueError) as info:
        ensemble.EnsembleLayout(mesh, num_members=size + 1)
    message = str(info.value)
    assert f"num_members={size + 1} cannot be split evenly" in message
    assert f"'ensemble' mesh axis of size {size}" in message
    assert f"multiple of {size}" in message and "Use num_members=" in message


@pytest.mark.once
def test_a_mesh_without_an_ensemble_axis_is_explained():
    with pytest.raises(ValueError) as info:
        ensemble.EnsembleLayout(meshkit.make_mesh("data=-1"), num_members=4)
    message = str(info.value)
    assert f"The mesh has axes {{'data': {jax.device_count()}}} but no 'ensemble' axis" in message
    assert "meshkit.make_mesh('ensemble=-1')" in message


@pytest.mark.once
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=-1"), 0), "at least 1"),
        (lambda: ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=-1"), 2.0), "must be an int"),  # type: ignore[arg-type]
        (lambda: ensemble.EnsembleLayout("ensemble=8", 8), "needs a jax.sharding.Mesh"),  # type: ignore[arg-type]
    ],
)
def test_bad_layout_arguments_are_explained(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.devices(8)
def test_extra_mesh_axes_are_explained():
    with pytest.raises(ValueError, match=r"has axes \{'model': 2\} besides 'ensemble' and 'data'"):
        ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=2,data=2,model=2"), 4)


@pytest.mark.once
def test_state_step_and_batch_mismatches_are_explained():
    layout = layout_for(2)
    state = ensemble.create_ensemble_state(tiny_model(), TX, layout)
    with pytest.raises(ValueError, match="out of range: the ensemble has 2 members"):
        ensemble.member_state(state, 2)
    four = ensemble.EnsembleLayout(layout.mesh, 4)
    step = ensemble.make_ensemble_step(ensemble.classification_loss, four)
    batch = meshkit.shard_batch(host_batches(1)[0], layout.batch_sharding)
    with pytest.raises(ValueError, match="The state holds 2 members but the step was built for 4"):
        step(state, batch)
    per_member = ensemble.make_ensemble_step(
        ensemble.classification_loss, layout, member_batches=True
    )
    with pytest.raises(ValueError, match=r"expects every batch field shaped \[rows, 2 members"):
        per_member(state, batch)


@pytest.mark.once
def test_member_batches_with_a_transform_on_threads_equal_those_built_in_line():
    """Threads take whole [rows, K, ...] batches (they used to take single examples)."""
    from meshkit.data import image

    layout = layout_for(2)
    pixels = (np.arange(64 * 8 * 8).reshape(64, 8, 8, 1) % 251).astype(np.uint8)
    source = data.ArraySource({"image": pixels, "label": np.arange(64) % 10})
    transform = image.train_transform(6, mean=0.5, std=0.25, channels=1)

    def pipeline(threads):
        return ensemble.MemberTrainPipeline(
            source,
            2,
            global_batch_size=16,
            sharding=layout.batch_sharding,
            transform=transform,
            input_settings=data.InputSettings(num_threads=threads),
        )

    in_line = pipeline(0).local_batch(1)
    threaded = next(iter(pipeline(2).dataset(start_step=1)))
    assert in_line["image"].shape == (16 // jax.process_count(), 2, 6, 6, 1)
    for key in in_line:
        np.testing.assert_array_equal(threaded[key], in_line[key])
