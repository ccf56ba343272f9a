"""The two member strategies, vmap and loop, train and evaluate the same members."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import data, ensemble, train
from meshkit.ensemble._strategy import resolve_strategy
from meshkit.models import NormCNN

# vmap and loop agree; the 8-device pass has several members per device too
pytestmark = pytest.mark.once(8)  # members spread over 8 devices: cheaper there than on 1

BATCH = 32
STEPS = 3
TX = optax.sgd(0.1, momentum=0.9)


def layout_for(members: int, axes: str | None) -> ensemble.EnsembleLayout:
    if axes is None:
        axes = f"ensemble={math.gcd(members, jax.device_count())},data=-1"
    return ensemble.EnsembleLayout(meshkit.make_mesh(axes), members)


def batches(members: int, member_batches: bool) -> list[dict[str, np.ndarray]]:
    """Shared batches ``[rows, ...]`` or own-order batches ``[rows, K, ...]``."""
    source = data.digits("train")
    rng = np.random.default_rng(0)
    shape = (BATCH, members) if member_batches else (BATCH,)
    return [source.getitems(rng.integers(0, len(source), shape).ravel()) for _ in range(STEPS)]


def train_with(layout, strategy, member_batches):
    """A few steps of NormCNN (batch norm and dropout): final state and per-step metrics."""
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    state = ensemble.create_ensemble_state(model, TX, layout, seed=3)
    step = ensemble.make_ensemble_step(
        ensemble.classification_loss, layout, member_batches=member_batches, strategy=strategy
    )
    metrics = []
    for rows in batches(layout.num_members, member_batches):
        host = rows
        if member_batches:
            host = {k: v.reshape(BATCH, layout.num_members, *v.shape[1:]) for k, v in rows.items()}
        state, step_metrics = step(state, meshkit.shard_batch(host, layout.batch_sharding))
        metrics.append(meshkit.to_host(step_metrics))  # read at once: one step in flight
    return meshkit.to_host(state), metrics


def assert_same(loop, vmap):
    (loop_state, loop_metrics), (vmap_state, vmap_metrics) = loop, vmap
    for a, b in zip(jax.tree.leaves(loop_state), jax.tree.leaves(vmap_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(loop_metrics, vmap_metrics, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    ("members", "axes", "member_batches"),
    [
        (1, None, False),
        (16, None, False),  # two members per device (and one when K = 8 is enough)
        (8, None, True),
        pytest.param(8, "ensemble=4,data=2", False, marks=pytest.mark.devices(8)),
    ],
)
def test_vmap_and_loop_train_the_same_members(members, axes, member_batches):
    layout = layout_for(members, axes)
    loop = train_with(layout, "loop", member_batches)
    vmap = train_with(layout, "vmap", member_batches)
    assert_same(loop, vmap)
    if members > 1:  # the members are distinct networks, not one trained K times
        assert vmap[1][0]["member_0/loss"] != vmap[1][0]["member_1/loss"]


def test_vmap_and_loop_predict_and_evaluate_alike():
    layout = layout_for(8, None)
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    state = ensemble.create_ensemble_state(model, TX, layout, seed=1)
    images = data.digits("test").getitems(np.arange(BATCH))
    inputs = meshkit.shard_batch(images["image"], layout.batch_sharding)
    loop_probs, loop_logits = ensemble.make_predict(layout, "loop")(state, inputs)
    vmap_probs, vmap_logits = ensemble.make_predict(layout, "vmap")(state, inputs)
    np.testing.assert_allclose(
        np.asarray(loop_logits), np.asarray(vmap_logits), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(np.asarray(loop_probs), np.asarray(vmap_probs), rtol=1e-5, atol=1e-6)
    batch = meshkit.shard_batch(images, layout.batch_sharding)
    loop_values = ensemble.ensemble_metrics(layout, "loop")(state, batch)
    vmap_values = ensemble.ensemble_metrics(layout, "vmap")(state, batch)
    for name, value in loop_values.items():
        np.testing.assert_allclose(value, vmap_values[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_auto_picks_the_loop_on_cpu_and_bad_strategies_are_explained():
    layout = layout_for(8, None)
    assert resolve_strategy("auto", layout) == "loop"
    with pytest.raises(ValueError, match=r"one of \['auto', 'vmap', 'loop'\], got 'scan'"):
        ensemble.make_ensemble_step(ensemble.classification_loss, layout, strategy="scan")  # pyright: ignore[reportArgumentType]
