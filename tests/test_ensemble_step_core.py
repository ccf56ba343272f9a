"""The ensemble step on the train step's gradient core: micro-batches and float16 per member."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import ensemble, train
from meshkit.models import NormCNN
from meshkit.train import _gradients
from tests.test_ensemble import assert_trees_close, host_batches, layout_for, tiny_model

pytestmark = pytest.mark.devices(8)  # members on 2 devices, each member's rows on 4

TX = optax.adam(1e-2)


def _run(
    layout,
    batches,
    *,
    microbatches=1,
    strategy: Literal["auto", "vmap", "loop"] = "auto",
    precision=None,
    state=None,
):
    if state is None:
        state = ensemble.create_ensemble_state(tiny_model(), TX, layout, precision=precision)
    step = ensemble.make_ensemble_step(
        ensemble.classification_loss,
        layout,
        microbatches=microbatches,
        strategy=strategy,
        donate=False,
    )
    history = []
    for batch in batches:
        state, metrics = step(state, meshkit.shard_batch(batch, layout.batch_sharding))
        history.append(meshkit.to_host(metrics))  # read at once: never a queue of steps
    return state, history


@pytest.mark.parametrize(
    ("strategy", "unrolled"),
    [("loop", True), ("vmap", False)],  # the CPU's choice; a GPU's (one loop, batched members)
)
def test_micro_batches_train_the_members_like_whole_batches(strategy, unrolled, monkeypatch):
    monkeypatch.setattr(_gradients, "unrolls_microbatches", lambda platform: unrolled)
    layout = layout_for(2, "ensemble=2,data=4")
    batches = host_batches(2)
    whole, whole_metrics = _run(layout, batches, strategy=strategy)
    split, split_metrics = _run(layout, batches, microbatches=4, strategy=strategy)
    assert_trees_close(
        meshkit.to_host(whole.params), meshkit.to_host(split.params), rtol=2e-5, atol=1e-6
    )
    for a, b in zip(whole_metrics, split_metrics, strict=True):
        assert sorted(a) == sorted(b)
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=2e-5, atol=1e-6)
    assert meshkit.to_host(split.step).tolist() == [2, 2]  # one update per step


def test_micro_batches_carry_each_members_batch_statistics(monkeypatch):
    monkeypatch.setattr(_gradients, "unrolls_microbatches", lambda platform: False)
    layout = layout_for(2, "ensemble=2,data=4")
    model = tiny_model(NormCNN())
    state = ensemble.create_ensemble_state(model, TX, layout)
    before = meshkit.to_host(state.collections["batch_stats"])
    trained, history = _run(layout, host_batches(1), microbatches=2, state=state)
    after = meshkit.to_host(trained.collections["batch_stats"])
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert np.isfinite(new).all() and not np.allclose(old, new)
        assert not np.allclose(new[0], new[1])  # each member keeps its own statistics
    assert np.isfinite(history[0]["loss"])


def test_batches_that_do_not_split_into_micro_batches_are_explained():
    layout = layout_for(2, "ensemble=2,data=4")
    with pytest.raises(ValueError, match=r"multiple of the 4 devices .* microbatches=3"):
        _run(layout, host_batches(1), microbatches=3)  # 32 rows, not a multiple of 12


def _with_member_scale(state: train.TrainState, member: int, scale: float) -> train.TrainState:
    assert state.loss_scale is not None
    scales = state.loss_scale.scale.at[member].set(scale)
    return state.replace(loss_scale=state.loss_scale.replace(scale=scales))


def test_float16_skips_an_overflowing_member_and_leaves_the_others_untouched():
    layout = layout_for(2, "ensemble=2,data=4")
    batches = host_batches(1)
    initial = ensemble.create_ensemble_state(tiny_model(), TX, layout, precision="f16")
    assert initial.loss_scale is not None
    assert meshkit.to_host(initial.loss_scale.scale).tolist() == [2.0**15, 2.0**15]
    # Member 0's scale overflows float16 in the backward pass (2^40 > 65504); member 1's not.
    overflowing = _with_member_scale(initial, 0, 2.0**40)
    skipped, skipped_metrics = _run(layout, batches, state=overflowing)
    normal, _ = _run(layout, batches, state=initial)

    start = meshkit.to_host(initial.params)
    after_skip, after_normal = meshkit.to_host(skipped.params), meshkit.to_host(normal.params)
    leaves = map(jax.tree.leaves, (start, after_skip, after_normal))
    for first, skip, plain in zip(*leaves, strict=True):
        np.testing.assert_array_equal(skip[0], first[0])  # member 0: its update skipped
        np.testing.assert_array_equal(skip[1], plain[1])  # member 1: as if 0 had not overflowed
        assert not np.array_equal(plain[1], first[1])
    metrics = skipped_metrics[0]
    assert ensemble.per_member(metrics, "skipped").tolist() == [1.0, 0.0]
    assert ensemble.per_member(metrics, "loss_scale").tolist() == [2.0**40, 2.0**15]
    assert ensemble.per_member(metrics, "grad_norm")[0] == 0.0
    assert metrics["skipped"] == 0.5
    assert skipped.loss_scale is not None
    assert meshkit.to_host(skipped.loss_scale.scale).tolist() == [2.0**39, 2.0**15]
    assert meshkit.to_host(skipped.step).tolist() == [1, 1]  # a skipped step still counts


def test_a_float16_member_steps_like_the_float16_train_step():
    layout = layout_for(2, "ensemble=2,data=4")
    batch = host_batches(1)[0]
    initial = ensemble.create_ensemble_state(tiny_model(), TX, layout, precision="f16")
    member = ensemble.member_state(initial, 1)
    trained, history = _run(layout, [batch], state=initial)

    sharding = meshkit.batch_sharding(layout.mesh, "data")
    plain_step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(member), sharding
    )
    alone, alone_metrics = plain_step(member, meshkit.shard_batch(batch, sharding))
    assert_trees_close(
        meshkit.to_host(ensemble.member_state(trained, 1).params),
        meshkit.to_host(alone.params),
        rtol=1e-4,
        atol=1e-6,
    )
    alone_metrics = meshkit.to_host(alone_metrics)
    for name in ("loss", "grad_norm", "loss_scale", "skipped"):
        np.testing.assert_allclose(
            ensemble.per_member(history[0], name)[1], alone_metrics[name], rtol=1e-3
        )
    assert jnp.dtype(ensemble.member_state(trained, 1).params["Dense_0"]["kernel"].dtype) == (
        jnp.float32
    )
