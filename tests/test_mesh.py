"""make_mesh: axis parsing, validation, axis types and topology routing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit._mesh import parse_axes


def test_parse_axes_from_string_and_mapping_agree():
    assert parse_axes("data=-1, ensemble=2") == {"data": -1, "ensemble": 2}
    assert parse_axes({"data": -1, "ensemble": 2}) == {"data": -1, "ensemble": 2}
    assert list(parse_axes("model=2,data=4")) == ["model", "data"]


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ("data=-1,model=-1", "At most one mesh axis may be -1"),
        ("data", "expected 'name=size'"),
        ("data=x", "expected 'name=size'"),
        ("data=2,data=2", "appears twice"),
        ({"data": 0}, "has size 0"),
        ({"1data": 2}, "not a valid identifier"),
        ({}, "at least one axis"),
    ],
)
def test_parse_axes_rejects_bad_input(axes, message):
    with pytest.raises(ValueError, match=message):
        parse_axes(axes)


def test_parse_axes_rejects_non_int_size():
    with pytest.raises(
        TypeError, match=r"Mesh axis .data. size must be an int, got 2\.5 \(float\)"
    ):
        parse_axes({"data": 2.5})  # type: ignore[dict-item]


def test_make_mesh_uses_all_devices_and_default_auto_types():
    mesh = meshkit.make_mesh("data=-1")
    assert mesh.shape == {"data": jax.device_count()}
    assert mesh.axis_types == (AxisType.Auto,)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.devices(8)
def test_make_mesh_two_axes_and_explicit_types():
    mesh = meshkit.make_mesh(
        {"data": 4, "model": 2}, axis_types={"data": AxisType.Explicit, "model": AxisType.Auto}
    )
    assert mesh.shape == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Auto)
    with pytest.raises(ValueError, match=r"multiply to 16 devices, but 8"):
        meshkit.make_mesh("data=8,model=2")


def test_make_mesh_bad_axis_types():
    with pytest.raises(ValueError, match="not mesh axes"):
        meshkit.make_mesh("data=-1", axis_types={"model": AxisType.Auto})
    with pytest.raises(TypeError, match="axis_types must be"):
        meshkit.make_mesh("data=-1", axis_types="auto")  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Just the attributes mesh_utils reads."""

    id: int
    slice_index: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def fake_devices(num_slices: int, per_slice: int) -> list[FakeDevice]:
    return [
        FakeDevice(id=s * per_slice + i, slice_index=s, process_index=s)
        for s in range(num_slices)
        for i in range(per_slice)
    ]


def slices_of(mesh: jax.sharding.Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.slice_index)(mesh.devices)


def test_fill_axis_and_product_mismatch_message():
    devices = fake_devices(1, 8)
    assert meshkit.make_mesh("data=-1,model=2", devices=devices).shape == {"data": 4, "model": 2}
    with pytest.raises(ValueError) as info:
        meshkit.make_mesh({"data": 3, "model": 2}, devices=devices)
    message = str(info.value)
    assert "multiply to 6" in message and "8 devices" in message and "'model': 2" in message
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        meshkit.make_mesh("data=-1,model=3", devices=devices)


def test_no_devices_or_a_device_twice_is_refused():
    with pytest.raises(ValueError, match=r"devices=\[\] \(no devices\)"):
        meshkit.make_mesh("data=-1", devices=[])
    twice = [jax.devices()[0]] * 2
    with pytest.raises(ValueError, match=r"twice in devices=.*each device once"):
        meshkit.make_mesh("data=-1", devices=twice)


def test_single_slice_goes_to_create_device_mesh(monkeypatch):
    calls = []
    from jax.experimental import mesh_utils

    real = mesh_utils.create_device_mesh
    monkeypatch.setattr(
        mesh_utils, "create_device_mesh", lambda *a, **k: calls.append("ici") or real(*a, **k)
    )
    mesh = meshkit.make_mesh({"data": 4, "model": 2}, devices=fake_devices(1, 8))
    assert calls == ["ici"]
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids, np.arange(8).reshape(4, 2))


def test_multi_slice_defaults_to_data_across_slices():
    devices = fake_devices(2, 4)
    mesh = meshkit.make_mesh({"data": 8}, devices=devices)
    np.testing.assert_array_equal(slices_of(mesh), [0, 0, 0, 0, 1, 1, 1, 1])


def test_multi_slice_with_dcn_axes_keeps_model_inside_a_slice():
    devices = fake_devices(2, 4)
    mesh = meshkit.make_mesh({"data": 4, "model": 2}, devices=devices, dcn_axes={"data": 2})
    # each model row lives in one slice; data crosses slices in blocks of two
    np.testing.assert_array_equal(slices_of(mesh), [[0, 0], [0, 0], [1, 1], [1, 1]])
    # the other way around: model spans the two slices
    mesh = meshkit.make_mesh({"data": 4, "model": 2}, devices=devices, dcn_axes="model=2")
    np.testing.assert_array_equal(slices_of(mesh), [[0, 1]] * 4)


def test_multi_slice_errors_name_the_fix():
    devices = fake_devices(2, 4)
    with pytest.raises(ValueError, match=r"dcn_axes=\{'data': 2\}"):
        meshkit.make_mesh({"model": 8}, devices=devices)
    with pytest.raises(ValueError, match="not mesh axes"):
        meshkit.make_mesh({"data": 8}, devices=devices, dcn_axes={"batch": 2})
    with pytest.raises(ValueError, match="must divide 3"):
        meshkit.make_mesh({"data": 3, "model": 2}, devices=fake_devices(2, 3), dcn_axes="data=2")
    with pytest.raises(ValueError, match="all devices are in one slice"):
        meshkit.make_mesh({"data": 8}, devices=fake_devices(1, 8), dcn_axes={"data": 2})


def _mlp_loss(x):
    import flax.linen as nn

    model = nn.Dense(4)
    params = model.init(jax.random.key(0), jnp.zeros((1, x.shape[1])))
    out = model.apply(params, x)
    assert isinstance(out, jax.Array)
    return jnp.mean(out**2)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_flax_linen_runs_on_both_axis_types(axis_type):
    mesh = meshkit.make_mesh("data=-1", axis_types=axis_type)
    x_np = np.linspace(-1, 1, 8 * 3, dtype=np.float32).reshape(8, 3)
    x = meshkit.shard_batch(x_np, meshkit.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        value = jax.jit(_mlp_loss, out_shardings=NamedSharding(mesh, P()))(x)
    np.testing.assert_allclose(value, _mlp_loss(jnp.asarray(x_np)), rtol=1e-6)


def _logreg(w, x, y):
    logits = x @ w
    return jnp.mean(
        jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
    )


@pytest.mark.once  # the same at any device count
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_jaxopt_runs_on_both_axis_types(axis_type):
    import jaxopt

    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(64, 5)).astype(np.float32)
    y_np = rng.integers(0, 3, size=64).astype(np.int32)
    mesh = meshkit.make_mesh("data=-1", axis_types=axis_type)
    sharding = meshkit.batch_sharding(mesh)
    x, y = meshkit.shard_batch((x_np, y_np), sharding)
    solver = jaxopt.LBFGS(fun=_logreg, maxiter=20)
    w0 = jnp.zeros((5, 3))
    with jax.set_mesh(mesh):
        w = jax.jit(lambda w, x, y: solver.run(w, x, y).params)(w0, x, y)
    one_device = jax.devices()[0]
    reference = jax.jit(lambda w, x, y: solver.run(w, x, y).params)(
        w0, jax.device_put(x_np, one_device), jax.device_put(y_np, one_device)
    )
    np.testing.assert_allclose(w, reference, rtol=1e-4, atol=1e-5)
