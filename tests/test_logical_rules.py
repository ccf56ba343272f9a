"""Logical axis rules: names on parameters and activations, mapped to mesh axes by a table."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict, meta
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import FSDP, PartitionRules, checkpoint
from meshkit import train as mtrain
from meshkit.evaluate._full_eval import _eval_step
from meshkit.evaluate._steps import per_example_values, zero_totals
from meshkit.evaluate._stream import _stream_step

TABLE = {"batch": "data", "embed": "data", "mlp": "model", "vocab": None}


def abstract(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def specs(rules, tree, mesh, names=None):
    return {p.path: p.spec for p in rules.resolve(tree, mesh, names=names)}


def logical_init(names, init=None):
    return nn.with_logical_partitioning(init or nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
    """A two-layer MLP with logical names on its parameters and on its hidden activation."""

    annotate: bool = True

    @nn.compact
    def __call__(self, x):
        if not self.annotate:
            h = nn.Dense(16)(x)
            return nn.Dense(4)(jnp.tanh(h))
        h = nn.Dense(
            16,
            kernel_init=logical_init(("embed", "mlp")),
            bias_init=logical_init(("mlp",), nn.initializers.zeros),
        )(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
        return nn.Dense(4, kernel_init=logical_init(("mlp", "vocab")))(h)


def mlp_model(annotate=True):
    return mtrain.linen_model(MLP(annotate), jnp.zeros((1, 8)))


def mlp_state(mesh, rules, *, annotate=True, tx=None):
    return mtrain.create_train_state(
        mlp_model(annotate), tx or optax.adam(0.1), mesh, rules=rules, seed=0
    )


def batch(mesh, rows=8, seed=0):
    rng = np.random.default_rng(seed)
    sharding = meshkit.batch_sharding(mesh)
    host = {
        "image": rng.normal(size=(rows, 8)).astype(np.float32),
        "label": rng.integers(0, 4, rows).astype(np.int32),
    }
    return meshkit.shard_batch(host, sharding), sharding


def lowered_step(state, mesh):
    data, sharding = batch(mesh)
    step = mtrain.make_train_step(
        mtrain.classification_loss, mtrain.state_shardings_of(state), sharding
    )
    return cast(Any, step).lower(state, data).as_text()  # make_train_step returns a jit


@pytest.mark.once
@pytest.mark.devices(8)  # a mesh of 4 × 2
def test_a_regex_wins_then_the_logical_names_then_the_default():
    mesh = meshkit.make_mesh("data=4,model=2")
    tree = {"a": abstract(64, 32), "b": abstract(64, 32), "c": abstract(64, 32)}
    names = {"a": ("embed", "mlp"), "b": ("embed", "mlp"), "c": None}
    rules = PartitionRules([("^a$", P("model"))], logical=TABLE, default=FSDP(min_size=0))
    placements = {p.path: p for p in rules.resolve(tree, mesh, names=names)}
    assert placements["a"].spec == P("model") and placements["a"].pattern == "^a$"
    assert placements["a"].logical is None  # the regex decided, not the names
    assert placements["b"].spec == P("data", "model") and placements["b"].logical == (
        "embed",
        "mlp",
    )
    assert placements["c"].spec == P("data") and placements["c"].pattern is None  # FSDP
    # Without a table the names are ignored: the default places every leaf.
    assert specs(PartitionRules(default=FSDP(min_size=0)), tree, mesh, names)["b"] == P("data")


@pytest.mark.once
@pytest.mark.devices(8)  # a mesh of 4 × 2
def test_dict_and_maxtext_pairs_agree_and_a_repeated_name_takes_a_free_axis():
    mesh = meshkit.make_mesh("data=4,model=2")
    tree = {"w": abstract(8, 16), "x": abstract(8, 16)}
    names = {"w": ("embed", "mlp"), "x": ("batch", "embed")}
    as_dict = PartitionRules(logical=TABLE)
    as_pairs = PartitionRules.from_logical([(k, [v] if v else v) for k, v in TABLE.items()])
    assert as_pairs.logical == as_dict.logical == tuple(TABLE.items())
    assert specs(as_dict, tree, mesh, names) == specs(as_pairs, tree, mesh, names)
    # Dict form: 'embed' wants 'data', which 'batch' holds: left unsharded, reported.
    (_, x) = as_dict.resolve(tree, mesh, names=names)
    assert x.spec == P("data")
    assert len(x.dropped) == 1 and "'embed'" in x.dropped[0] and "'data'" in x.dropped[0]
    # MaxText form with a second entry for 'embed': the first free one applies.
    table = [("batch", "data"), ("embed", "data"), ("embed", "model"), ("mlp", "model")]
    got = {p.path: p for p in PartitionRules(logical=table).resolve(tree, mesh, names=names)}
    assert got["x"].spec == P("data", "model") and got["x"].dropped == ()
    assert got["w"].spec == P("data", "model")  # 'embed' gets 'data' first, as in flax
    # Flax resolves the same names to the same spec.
    with nn.logical_axis_rules(tuple(table)):
        assert nn.logical_to_mesh_axes(("batch", "embed")) == P("data", "model")
    # A list of axes shards one dimension over their product.
    wide = PartitionRules(logical={"embed": ["data", "model"], "mlp": None})
    assert wide.resolve(tree["w"], mesh, names=names["w"])[0].spec == P(("data", "model"))


@pytest.mark.once
@pytest.mark.devices(8)  # a mesh of 4 × 2
def test_an_unknown_logical_name_says_which_leaf_and_how_to_fix_it():
    mesh = meshkit.make_mesh("data=4,model=2")
    rules = PartitionRules(logical={"embed": "data"})
    tree = {"layer": {"kernel": abstract(8, 16)}}
    with pytest.raises(ValueError, match=r"layer/kernel.*'heads'.*Add it to the table.*None"):
        rules.resolve(tree, mesh, names={"layer": {"kernel": ("embed", "heads")}})
    with pytest.raises(ValueError, match=r"Unknown mesh axis 'tensor'.*'mlp'"):
        PartitionRules(logical={"mlp": "tensor"}).resolve(tree, mesh)
    with pytest.raises(ValueError, match=r"3 dims"):
        rules.resolve(tree, mesh, names={"layer": {"kernel": ("embed", None, None)}})
    with pytest.raises(TypeError, match=r"'embed' maps to 3"):
        PartitionRules(logical={"embed": 3})
    with pytest.raises(TypeError, match=r"a dict or a sequence of \(name, mesh axes\) pairs"):
        PartitionRules(logical=cast(Any, "embed"))
    assert PartitionRules(logical=FrozenDict(TABLE)).logical == tuple(TABLE.items())


@pytest.mark.once
@pytest.mark.devices(8)  # a mesh of 4 × 2
def test_a_mesh_axis_that_does_not_divide_is_reported(caplog):
    mesh = meshkit.make_mesh("data=4,model=2")
    tree = {"table": abstract(7, 16)}
    rules = PartitionRules(logical={"vocab": "data", "embed": "model"})
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        shardings = meshkit.infer_shardings(tree, mesh, rules, names={"table": ("vocab", "embed")})
    assert shardings["table"].spec == P(None, "model")
    assert "table: dimension of size 7 is not divisible by mesh axis 'data'" in caplog.text


@pytest.mark.once
@pytest.mark.devices(8)  # a mesh of 4 × 2
def test_linen_boxes_and_nnx_metadata_are_read():
    module = MLP()
    boxed = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 8)))
    expected = {
        "Dense_0": {"bias": ("mlp",), "kernel": ("embed", "mlp")},
        "Dense_1": {"bias": None, "kernel": ("mlp", "vocab")},
    }
    assert meshkit.logical_axes(boxed) == {"params": expected}
    mesh = meshkit.make_mesh("data=4,model=2")
    shardings = meshkit.infer_shardings(boxed, mesh, PartitionRules(logical=TABLE))
    assert shardings["params"]["Dense_0"]["kernel"].spec == P("data", "model")
    assert shardings["params"]["Dense_1"]["kernel"].spec == P("model")
    params = jax.jit(module.init, out_shardings=shardings)(jax.random.key(0), jnp.zeros((1, 8)))
    assert params["params"]["Dense_0"]["kernel"].value.sharding.spec == P("data", "model")
    # nn.with_partitioning's names are logical names too: map a mesh axis to itself.
    layer = nn.Dense(16, kernel_init=nn.with_partitioning(nn.initializers.ones, ("model", None)))
    plain_boxed = jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((1, 8)))
    got = specs(PartitionRules(logical={"model": "model"}), plain_boxed, mesh)
    assert got == {"params/bias": P(), "params/kernel": P("model")}

    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with nnx.use_eager_sharding(False):
        linear = nnx.eval_shape(lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)))
    state = nnx.state(linear, nnx.Param)
    names = jax.tree.leaves(meshkit.logical_axes(state), is_leaf=lambda x: isinstance(x, tuple))
    assert names == [("embed", "mlp")]  # the bias has no names
    got = specs(PartitionRules(logical=TABLE), state, mesh)
    assert got == {"bias/value": P(), "kernel/value": P("data", "model")}


@pytest.mark.devices(8)
def test_the_train_state_places_an_annotated_mlp_and_its_adam_moments():
    mesh = meshkit.make_mesh("data=4,model=2")
    state = mlp_state(mesh, PartitionRules(logical=TABLE))
    kernel = state.params["Dense_0"]["kernel"]
    assert isinstance(kernel, jax.Array) and not isinstance(kernel, meta.AxisMetadata)  # unboxed
    expected = {
        "Dense_0/kernel": P("data", "model"),
        "Dense_0/bias": P("model"),
        "Dense_1/kernel": P("model"),
        "Dense_1/bias": P(),
    }
    for path, spec in expected.items():
        layer, leaf = path.split("/")
        assert state.params[layer][leaf].sharding.spec == spec, path
        for moment in ("mu", "nu"):
            assert getattr(state.opt_state[0], moment)[layer][leaf].sharding.spec == spec
    # Same values as the same model without names, replicated: names change only layout.
    plain = mlp_state(mesh, None, annotate=False)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    report = meshkit.describe(state, names=state.logical_axes(), show_mesh=False)
    assert "('embed', 'mlp')  P('data', 'model')" in report


@pytest.mark.devices(8)
def test_nnx_sharding_metadata_places_the_train_state():
    mesh = meshkit.make_mesh("data=4,model=2")
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    model = mtrain.nnx_model(lambda rngs: nnx.Linear(8, 16, kernel_init=init, rngs=rngs))
    state = mtrain.create_train_state(
        model, optax.adam(0.1), mesh, rules=PartitionRules(logical=TABLE)
    )
    assert state.params["kernel"][...].sharding.spec == P("data", "model")
    assert state.opt_state[0].mu["kernel"][...].sharding.spec == P("data", "model")
    assert state.params["bias"][...].sharding.spec == P()


@pytest.mark.devices(8)
def test_an_activation_constraint_reaches_the_compiled_step():
    mesh = meshkit.make_mesh("data=4,model=2")
    state = mlp_state(mesh, PartitionRules(logical=TABLE))
    text = lowered_step(state, mesh)
    assert '<@mesh, [{"data"}, {"model"}]> : tensor<8x16xf32>' in text
    # The hidden activation is split over both axes on each device: 8 rows / 4, 16 / 2.
    data, _ = batch(mesh)
    compiled = jax.jit(lambda s, x: mtrain.apply_model(s, x)[0]).lower(state, data["image"])
    assert "f32[2,8]" in (compiled.compile().as_text() or "")
    assert '[{"data"}, {"model"}]' in compiled.as_text()  # eval through apply_model too

    # An evaluation function that calls apply_fn itself gets the table through
    # per_example_values, the evaluation steps' call of the function.
    def logits(state, batch):
        return {"logits": state.apply_fn({"params": state.params}, batch["image"])}

    constraint = re.compile(r'sdy\.sharding_constraint %\d+ <@mesh, \[\{"data"\}, \{"model"\}\]>')
    lowered = jax.jit(functools.partial(per_example_values, logits)).lower(state, data)
    assert constraint.search(lowered.as_text())
    assert not constraint.search(jax.jit(logits).lower(state, data).as_text())  # no scope

    # ... and so do full_eval's and stream_eval's steps, which call it.
    def row_sums(state, batch):
        return {"total": state.apply_fn({"params": state.params}, batch["image"]).sum(-1)}

    masked = {**data, "mask": jnp.ones(len(data["image"]), bool), "more": jnp.array(False)}
    totals = zero_totals(row_sums, state, masked, mesh)
    for step in (_eval_step(row_sums, (), mesh), _stream_step(row_sums, mesh)):
        assert constraint.search(step.lower(state, masked, totals).as_text())
    # Without a table the names do nothing: no constraint.
    assert not constraint.search(lowered_step(mlp_state(mesh, None), mesh))


@pytest.mark.devices(8)
def test_without_names_a_logical_table_leaves_the_step_unchanged():
    mesh = meshkit.make_mesh("data=4,model=2")
    plain = lowered_step(mlp_state(mesh, None, annotate=False), mesh)
    with_table = lowered_step(mlp_state(mesh, PartitionRules(logical=TABLE), annotate=False), mesh)
    assert with_table == plain


@pytest.mark.devices(8)
def test_a_checkpoint_on_one_layout_restores_on_another(tmp_path):
    rules = PartitionRules(logical=TABLE)
    first_mesh = meshkit.make_mesh("data=8,model=1")
    state = mlp_state(first_mesh, rules, tx=optax.sgd(0.1))
    data, sharding = batch(first_mesh)
    step = mtrain.make_train_step(
        mtrain.classification_loss, mtrain.state_shardings_of(state), sharding
    )
    state, _ = step(state, data)
    saved = meshkit.to_host(state)
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (1, 16)  # 'model' has size 1 here
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    checkpointer.save(1, state, {"step": 1})
    checkpointer.wait()

    second_mesh = meshkit.make_mesh("data=4,model=2")
    target = mlp_state(second_mesh, rules, tx=optax.sgd(0.1))
    restored, data_state = checkpointer.restore(target)
    checkpointer.close()
    assert data_state == {"step": 1}
    kernel = restored.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")
    assert kernel.sharding.shard_shape(kernel.shape) == (2, 8)
    assert restored.params["Dense_1"]["kernel"].sharding.spec == P("model")
    assert restored.activation_rules is not None and restored.activation_rules.mesh == second_mesh
    for a, b in zip(
        jax.tree.leaves(saved), jax.tree.leaves(meshkit.to_host(restored)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.once(8)
def test_an_annotated_model_trains_like_the_unannotated_one():
    mesh = meshkit.make_mesh("data=-1,model=1")
    losses = {}
    for annotate in (True, False):
        rules = PartitionRules(logical=TABLE) if annotate else None
        state = mlp_state(mesh, rules, annotate=annotate, tx=optax.sgd(0.1))
        data, sharding = batch(mesh)
        step = mtrain.make_train_step(
            mtrain.classification_loss, mtrain.state_shardings_of(state), sharding
        )
        losses[annotate] = []
        for _ in range(3):
            state, metrics = step(state, data)
            losses[annotate].append(float(metrics["loss"]))
    assert losses[True][-1] < losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


@pytest.mark.once
def test_a_stacked_state_keeps_the_names_but_applies_them_to_no_leaf():
    keys = jax.random.split(jax.random.key(0), 2)
    states = jax.vmap(
        lambda key: mtrain.parts.init_state_from_key(mlp_model(), optax.adam(0.1), key)
    )(keys)
    assert dict(states.param_axes)["Dense_0/kernel"] == ("embed", "mlp")
    assert states.params["Dense_0"]["kernel"].shape == (2, 8, 16)
    names = states.logical_axes()
    assert names.params["Dense_0"]["kernel"] is None  # one more dimension than named
    assert names.opt_state[0].mu["Dense_0"]["kernel"] is None


class AnnotationStyles(nn.Module):
    """The three linen annotation styles in one model: ``param_with_axes`` (names in a
    ``params_axes`` collection), ``nn.with_partitioning`` naming a mesh axis, and
    ``nn.with_logical_partitioning`` naming a logical axis."""

    @nn.compact
    def __call__(self, x, train=False):
        from flax.linen import partitioning as nnp

        w = nnp.param_with_axes("w", nn.initializers.ones, (16, 8), axes=("embed", "mlp"))
        h = jnp.tanh(x.reshape(len(x), -1) @ w)
        mesh_axes = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        h = nn.Dense(8, kernel_init=mesh_axes, name="by_mesh_axes")(h)
        return nn.Dense(4, kernel_init=logical_init(("mlp", "vocab")), name="logical")(h)


@pytest.mark.devices(8)
def test_every_annotation_style_places_its_parameter_and_none_is_replicated_silently(caplog):
    mesh = meshkit.make_mesh("data=4,model=2")
    model = mtrain.linen_model(AnnotationStyles(), jnp.zeros((1, 4, 4)))
    tx = optax.adam(0.1)

    def kernel_specs(state):
        return {
            "w": state.params["w"].sharding.spec,
            "by_mesh_axes": state.params["by_mesh_axes"]["kernel"].sharding.spec,
            "logical": state.params["logical"]["kernel"].sharding.spec,
            "w mu": state.opt_state[0].mu["w"].sharding.spec,
        }

    # No table: a name that is a mesh axis means that axis (Flax's meaning); logical
    # names have nothing to map them, so their leaves stay replicated, and say so.
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        state = mtrain.create_train_state(model, tx, mesh)
    assert kernel_specs(state) == {
        "w": P(),
        "by_mesh_axes": P(None, "model"),
        "logical": P(),
        "w mu": P(),
    }
    warned = caplog.text
    assert "params/w: annotated ('embed', 'mlp')" in warned
    assert "params/logical/kernel: annotated ('mlp', 'vocab')" in warned
    assert "by_mesh_axes" not in warned and "PartitionRules(logical=" in warned
    assert sorted(state.collections) == []  # params_axes is metadata, not state
    assert dict(state.param_axes)["w"] == ("embed", "mlp")

    # A table maps the logical names; the mesh-axis name needs no entry.
    caplog.clear()
    rules = PartitionRules(logical={"embed": None, "mlp": "data", "vocab": None})
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        state = mtrain.create_train_state(model, tx, mesh, rules=rules)
    assert kernel_specs(state) == {
        "w": P(None, "data"),
        "by_mesh_axes": P(None, "model"),
        "logical": P("data"),
        "w mu": P(None, "data"),
    }
    assert caplog.text == ""
    sharding = meshkit.batch_sharding(mesh)
    step = mtrain.make_train_step(
        mtrain.classification_loss, mtrain.state_shardings_of(state), sharding
    )
    batch = {"image": np.ones((8, 4, 4), np.float32), "label": np.zeros(8, np.int32)}
    _, metrics = step(state, meshkit.shard_batch(batch, sharding))
    assert np.isfinite(float(metrics["loss"]))

    # NNX: nnx.with_partitioning names mesh axes too.
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    nnx_model = mtrain.nnx_model(lambda rngs: nnx.Linear(8, 16, kernel_init=init, rngs=rngs))
    state = mtrain.create_train_state(nnx_model, tx, mesh)
    assert state.params["kernel"][...].sharding.spec == P(None, "model")


@pytest.mark.devices(8)
def test_a_mesh_axis_that_places_nothing_is_named_once_with_the_fix(caplog):
    from meshkit.train import _state

    model = mtrain.linen_model(nn.Dense(8), jnp.zeros((1, 8)))
    _state._WARNED_UNUSED.clear()
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        mtrain.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=4,modle=2"))
        mtrain.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=4,modle=2"))
    warnings = [r.getMessage() for r in caplog.records if "places no parameter" in r.getMessage()]
    assert warnings == [
        "Mesh axis 'modle' (size 2; a typo for 'model'?) of the mesh {'data': 4, 'modle': 2} "
        "places no parameter or optimizer state and is not a batch axis: its 2 devices would "
        "each repeat the same work. Shard parameters over it (PartitionRules, a logical "
        "table, nn.with_partitioning) or leave it out of the mesh."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshkit"):  # used: no warning
        wide = mtrain.linen_model(nn.Dense(64), jnp.zeros((1, 64)))
        rules = PartitionRules([(".*kernel", P(None, "model"))])
        mtrain.create_train_state(
            wide, optax.sgd(0.1), meshkit.make_mesh("data=4,model=2"), rules=rules
        )
        mtrain.create_train_state(model, optax.sgd(0.1), meshkit.make_mesh("data=8"))
    assert "places no parameter" not in caplog.text
