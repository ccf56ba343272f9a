"""PartitionRules and infer_shardings."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit import PartitionRules


def abstract(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


PARAMS = {
    "params": {
        "Conv_0": {"kernel": abstract(3, 3, 1, 32), "bias": abstract(32)},
        "Dense_0": {"kernel": abstract(800, 256), "bias": abstract(256)},
        "Dense_1": {"kernel": abstract(256, 10), "bias": abstract(10)},
    }
}


@pytest.mark.devices(8)
def test_first_match_wins_and_default_applies():
    mesh = meshkit.make_mesh("data=4,model=2")
    rules = PartitionRules(
        [
            (r"Dense_0/kernel", P(None, "model")),
            (r"kernel", P("data")),
        ]
    )
    specs = jax.tree.map(lambda s: s.spec, meshkit.infer_shardings(PARAMS, mesh, rules))
    assert specs["params"]["Dense_0"]["kernel"] == P(None, "model")
    assert specs["params"]["Dense_1"]["kernel"] == P("data")
    assert specs["params"]["Conv_0"]["bias"] == P()
    placements = {p.path: p for p in rules.resolve(PARAMS, mesh)}
    assert placements["params/Dense_0/kernel"].pattern == "Dense_0/kernel"
    assert placements["params/Dense_1/bias"].pattern is None


@pytest.mark.devices(8)
def test_fsdp_shards_largest_divisible_dimension_and_skips_small():
    mesh = meshkit.make_mesh("data=8")
    rules = PartitionRules.fsdp("data", min_size=1000)
    specs = {p.path: p.spec for p in rules.resolve(PARAMS, mesh)}
    assert specs["params/Dense_0/kernel"] == P("data")  # 800 > 256, both divisible
    assert specs["params/Dense_1/kernel"] == P("data")  # 256 divisible, 10 is not
    assert specs["params/Conv_0/kernel"] == P()  # 288 elements < min_size
    assert specs["params/Dense_0/bias"] == P()
    tree = {"w": abstract(7, 9, 24)}
    assert PartitionRules.fsdp(min_size=0).resolve(tree, mesh)[0].spec == P(None, None, "data")


@pytest.mark.devices(8)
def test_fsdp_threshold_in_bytes_treats_mixed_dtypes_alike():
    tree = {
        "bf16_64k": abstract(256, 128, dtype=jnp.bfloat16),  # 32768 elements, 64 KiB
        "f32_64k": abstract(256, 64),  # 16384 elements, 64 KiB
        "bf16_32k": abstract(128, 128, dtype=jnp.bfloat16),  # 16384 elements, 32 KiB
        "f32_32k": abstract(128, 64),  # 8192 elements, 32 KiB
    }
    mesh = meshkit.make_mesh("data=8")
    by_bytes = PartitionRules([(".*", meshkit.FSDP("data", min_bytes=64 * 1024))])
    specs = {p.path: p.spec for p in by_bytes.resolve(tree, mesh)}
    assert specs == {"bf16_64k": P("data"), "f32_64k": P("data"), "bf16_32k": P(), "f32_32k": P()}
    # No element count does the same: the 64 KiB float32 leaf has as many elements as
    # the 32 KiB bfloat16 one.
    by_elements = PartitionRules([(".*", meshkit.FSDP("data", min_size=16384))])
    specs = {p.path: p.spec for p in by_elements.resolve(tree, mesh)}
    assert specs["bf16_32k"] == P(None, "data") and specs["f32_64k"] == P("data")
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        meshkit.FSDP(min_bytes=-1)


@pytest.mark.devices(8)
def test_fsdp_chained_after_a_dimension_rule_shards_what_the_base_leaves():
    mesh = meshkit.make_mesh("data=4,model=2")
    rule = meshkit.FSDP("data", min_size=0, base=P(None, "model"))
    tree = {
        "wide": abstract(256, 1024),  # the base takes 1024; FSDP the largest left: 256
        "tall": abstract(1024, 256),
        "odd": abstract(6, 512),  # nothing left divisible by 4: the base alone
    }
    placements = {p.path: p for p in PartitionRules([(".*", rule)]).resolve(tree, mesh)}
    assert placements["wide"].spec == P("data", "model")
    assert placements["tall"].spec == P("data", "model")
    assert placements["odd"].spec == P(None, "model")
    assert "no unsharded dimension of shape (6, 512)" in placements["odd"].dropped[0]
    assert repr(rule) == "FSDP(axis='data', min_size=0, base=P(None, 'model'))"
    with pytest.raises(ValueError, match="the base already uses"):
        meshkit.FSDP("model", base=P(None, "model"))
    with pytest.raises(ValueError, match=r"tensor"):
        PartitionRules([(".*", meshkit.FSDP("data", base=P("tensor")))]).resolve(tree, mesh)


@pytest.mark.devices(8)
def test_fsdp_with_no_divisible_dimension_is_reported(caplog):
    mesh = meshkit.make_mesh("data=8")
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        shardings = meshkit.infer_shardings(
            {"w": abstract(7, 9)}, mesh, PartitionRules.fsdp(min_size=0)
        )
    assert shardings["w"].spec == P()
    assert "no dimension of shape (7, 9) is divisible" in caplog.text


@pytest.mark.devices(8)
def test_axis_that_does_not_divide_is_dropped_and_reported(caplog):
    mesh = meshkit.make_mesh("data=4,model=2")
    rules = PartitionRules([("bias", P(("data", "model")))])
    with caplog.at_level(logging.WARNING, logger="meshkit"):
        shardings = meshkit.infer_shardings(PARAMS, mesh, rules)
    assert shardings["params"]["Dense_1"]["bias"].spec == P()  # 10 % 8, 10 % 4
    assert shardings["params"]["Conv_0"]["bias"].spec == P(("data", "model"))
    assert (
        "params/Dense_1/bias: dimension of size 10 is not divisible by mesh axis 'model'"
        in caplog.text
    )
    assert "mesh axis 'data' (size 4)" in caplog.text


def test_unknown_axis_in_rule_names_rule_and_mesh_axes():
    mesh = meshkit.make_mesh("data=-1")
    with pytest.raises(ValueError) as info:
        meshkit.infer_shardings(PARAMS, mesh, PartitionRules([("kernel", P("model"))]))
    message = str(info.value)
    assert "'model'" in message and "'kernel'" in message and "['data']" in message
    with pytest.raises(ValueError, match="Unknown mesh axis 'fsdp'"):
        meshkit.infer_shardings(PARAMS, mesh, PartitionRules.fsdp("fsdp"))


def test_spec_longer_than_leaf_names_leaf_and_shape():
    mesh = meshkit.make_mesh("data=-1")
    with pytest.raises(ValueError) as info:
        meshkit.infer_shardings(PARAMS, mesh, PartitionRules([("bias", P(None, "data"))]))
    assert "params/Conv_0/bias" in str(info.value) and "(32,)" in str(info.value)


def test_rules_reject_bad_entries():
    with pytest.raises(TypeError, match=r"PartitionSpec or meshkit\.FSDP"):
        PartitionRules([("kernel", ("data",))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a valid regex"):
        PartitionRules([("(", P())])
    with pytest.raises(TypeError, match=r"\(regex, rule\) pair"):
        PartitionRules(["kernel"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"meshkit\.PartitionRules"):
        meshkit.infer_shardings(PARAMS, meshkit.make_mesh("data=-1"), [("a", P())])  # type: ignore[arg-type]


@pytest.mark.devices(8)
def test_inferred_shardings_place_real_arrays():
    mesh = meshkit.make_mesh("data=8")
    shardings = meshkit.infer_shardings(PARAMS, mesh, PartitionRules.fsdp(min_size=1000))
    init = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), PARAMS), out_shardings=shardings
    )
    params = init()
    kernel = params["params"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(100, 256)}
    np.testing.assert_array_equal(np.asarray(kernel), np.ones((800, 256)))
