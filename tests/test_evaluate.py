"""meshkit.evaluate: full_eval, pad_shard_unpad and stream_eval against numpy."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit.data import ArraySource, EvalPipeline
from meshkit.evaluate import full_eval, pad_shard_unpad, stream_eval

D = jax.device_count()
B = 128  # global batch
SIZES = sorted({0, 1, D - 1 or 1, D, D + 1, B - 1, B, B + 1, 4097})


def per_example(w, batch):
    pred = batch["x"] * w
    return {
        "abs_error": jnp.abs(pred - batch["y"]),
        "ratio": batch["x"] / batch["x"],  # 0 / 0 = NaN on every padded row
        "pred": pred,
    }


def arrays(n: int) -> dict[str, np.ndarray]:
    x = np.arange(1, n + 1, dtype=np.float32)
    return {"x": x, "y": 3 * x + (np.arange(n) % 5).astype(np.float32)}


@pytest.mark.parametrize("n", SIZES)
def test_full_eval_counts_every_example_once_and_matches_numpy(n):
    mesh = meshkit.make_mesh("data=-1")
    data = arrays(n)
    result = full_eval(per_example, 3.0, data, mesh=mesh, batch_size=B, collect=["pred"])
    assert result.count == n and result.num_steps == -(-n // B)
    if n == 0:
        assert result.metrics == {} and result.per_example["pred"].shape == (0,)
        return
    np.testing.assert_allclose(result.metrics["abs_error"], np.mean(np.arange(n) % 5), rtol=1e-6)
    assert result.metrics["ratio"] == 1.0  # NaNs from padding did not leak
    np.testing.assert_array_equal(result.per_example["pred"], 3 * data["x"])


def test_a_non_finite_example_is_counted_by_name_and_warned_about():
    mesh = meshkit.make_mesh("data=-1")
    clean = full_eval(per_example, 3.0, arrays(20), mesh=mesh, batch_size=B)
    assert sorted(clean.metrics) == ["abs_error", "pred", "ratio"]  # no count when none
    data = arrays(20)
    data["x"][[4, 11]] = 0.0  # 0 / 0: two real examples give a NaN ratio
    for evaluate in (full_eval, stream_eval):
        with pytest.warns(UserWarning, match=r"of 20 examples, 2 gave a non-finite ratio"):
            if evaluate is full_eval:
                result = full_eval(per_example, 3.0, data, mesh=mesh, batch_size=B)
            else:
                batches = [{k: v[i : i + 8] for k, v in data.items()} for i in range(0, 20, 8)]
                result = stream_eval(per_example, 3.0, iter(batches), mesh=mesh, rows_per_process=8)
        assert result.metrics["nonfinite/ratio"] == 2 and np.isnan(result.metrics["ratio"])
        assert "nonfinite/abs_error" not in result.metrics and result.count == 20


def test_full_eval_compiles_once_for_every_size():
    mesh = meshkit.make_mesh("data=-1")

    def fresh(w, batch):  # a function of its own: nothing compiled for it yet
        return per_example(w, batch)

    with meshkit.count_compiles() as log:
        for n in (B + 1, 4097, 5, B):
            full_eval(fresh, 3.0, arrays(n), mesh=mesh, batch_size=B, collect=["pred"])
    assert log.count("eval_step") == 1


def test_a_batch_level_value_is_an_error_naming_it():
    mesh = meshkit.make_mesh("data=-1")
    fix = "Return one value per example, e.g. a vector of shape (batch,), not its mean."
    data = {"x": np.arange(10.0)}

    def expected(who: str, shape: tuple[int, ...], rows: int = 8) -> str:
        return (
            re.escape(
                f"{who}'s per_example_fn returned 'm' with shape {shape}, but per-example values "
                f"need the batch's leading dimension, {rows}"
            )
            + ".*"
            + re.escape(fix)
        )

    mean = lambda w, b: {"m": jnp.mean(b["x"])}  # noqa: E731
    with pytest.raises(ValueError, match=expected("full_eval", ())):
        full_eval(mean, None, data, mesh=mesh, batch_size=8)
    with pytest.raises(ValueError, match=expected("full_eval", ())):
        full_eval(mean, None, data, mesh=mesh, batch_size=8, collect=["m"])
    half = lambda w, b: {"m": b["x"][:4]}  # noqa: E731
    with pytest.raises(ValueError, match=expected("full_eval", (4,))):
        full_eval(half, None, data, mesh=mesh, batch_size=8)
    with pytest.raises(ValueError, match=expected("stream_eval", (), rows=16)):
        stream_eval(mean, None, [data], mesh=mesh, rows_per_process=16)


def test_per_example_values_give_exact_means():
    mesh = meshkit.make_mesh("data=-1")
    data = {"x": np.arange(10.0)}
    result = full_eval(lambda w, b: {"m": b["x"]}, None, data, mesh=mesh, batch_size=8)
    assert result.metrics == {"m": 4.5} and result.count == 10  # not 3.225: padding excluded

    def rows_of_8(w, batch):  # a trailing axis as long as the batch: rows are masked, not columns
        return {"v": batch["x"][:, None] * jnp.ones((1, 8)), "m": batch["x"]}

    result = full_eval(rows_of_8, None, data, mesh=mesh, batch_size=8)
    assert result.metrics == {"v": 8 * 4.5, "m": 4.5}


def test_full_eval_bad_arguments():
    mesh = meshkit.make_mesh("data=-1")
    with pytest.raises(ValueError, match="needs mesh= and batch_size="):
        full_eval(per_example, 3.0, arrays(4), mesh=mesh)
    pipeline = EvalPipeline(
        ArraySource(arrays(4)),
        global_batch_size=B,
        sharding=meshkit.batch_sharding(mesh),
    )
    with pytest.raises(ValueError, match="already has its sharding"):
        full_eval(per_example, 3.0, pipeline, mesh=mesh, batch_size=B)


@pytest.mark.parametrize("n", [1, D + 1, 37])
def test_pad_shard_unpad_returns_exactly_the_rows(n):
    mesh = meshkit.make_mesh("data=-1")
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    w = np.ones((3, 2), np.float32)
    predict = jax.jit(lambda w, x: x @ w)
    out = pad_shard_unpad(predict, mesh)(w, x)
    np.testing.assert_allclose(out, x @ w)


def test_pad_shard_unpad_with_min_batch_compiles_once():
    mesh = meshkit.make_mesh("data=-1")

    def predict(w, x):
        return x @ w

    wrapped = pad_shard_unpad(jax.jit(predict), mesh, min_batch=64)
    with meshkit.count_compiles() as log:
        for n in (64, 3, 50):
            x = np.full((n, 3), 2.0, np.float32)
            np.testing.assert_allclose(
                wrapped(np.ones((3, 1), np.float32), x), np.full((n, 1), 6.0)
            )
    assert log.count("predict") == 1
    with pytest.raises(ValueError, match="min_batch=64"):
        wrapped(np.ones((3, 1)), np.ones((65, 3)))


def test_pad_shard_unpad_static_return_with_mask():
    mesh = meshkit.make_mesh("data=-1")

    @jax.jit
    def count_correct(labels, predictions, mask):
        return jnp.sum(mask & (labels == predictions)), jnp.sum(mask)

    wrapped = pad_shard_unpad(
        count_correct, mesh, static_argnums=(), static_return=True, with_mask=True
    )
    labels = np.array([1, 2, 3, 0, 0])
    correct, total = wrapped(labels, np.array([1, 2, 0, 0, 1]))
    assert (int(correct), int(total)) == (3, 5)  # zero padding would add false matches unmasked


def test_pad_shard_unpad_rejects_mismatched_rows():
    mesh = meshkit.make_mesh("data=-1")
    wrapped = pad_shard_unpad(jax.jit(lambda a, b: a + b), mesh, static_argnums=())
    rows = "{\"['args'][0]\": 3, \"['args'][1]\": 4}"
    with pytest.raises(ValueError, match=re.escape(f"different numbers of rows: {rows}")):
        wrapped(np.ones(3), np.ones(4))
    keyword = pad_shard_unpad(jax.jit(lambda w, a, *, b: w * a + b), mesh)
    rows = "{\"['args'][1]\": 3, \"['kwargs']['b']\": 4}"
    with pytest.raises(ValueError, match=re.escape(f"different numbers of rows: {rows}")):
        keyword(2.0, np.ones(3), b=np.ones(4))


PAD_DTYPES = [np.float32, np.uint8, jnp.bfloat16, np.int32]
PAD_ROWS = sorted({1, max(D - 1, 1), D, D + 1, 2 * D + 3})


def _affine_input(rows: int, dtype) -> np.ndarray:
    return (np.arange(rows * 3) % 200).reshape(rows, 3).astype(dtype)


def _assert_same(out, expected) -> None:
    expected = np.asarray(expected)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_array_equal(out.astype(np.float64), expected.astype(np.float64))


@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=lambda dtype: np.dtype(dtype).name)
@pytest.mark.parametrize("n", PAD_ROWS)
def test_pad_shard_unpad_passes_static_keywords_through(n, dtype):
    mesh = meshkit.make_mesh("data=-1")
    affine = jax.jit(lambda params, a, *, b: params * a + b, static_argnames=("b",))
    x = _affine_input(n, dtype)
    out = pad_shard_unpad(affine, mesh, static_argnames=("b",))(5, x, b=10)
    assert out.dtype == np.dtype(dtype)
    _assert_same(out, affine(5, x, b=10))
    one_name = pad_shard_unpad(affine, mesh, static_argnames="b", min_batch=2 * D + 3)
    _assert_same(one_name(5, x, b=10), affine(5, x, b=10))


@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=lambda dtype: np.dtype(dtype).name)
@pytest.mark.parametrize("n", PAD_ROWS)
def test_pad_shard_unpad_batches_other_keywords_like_flax(n, dtype):
    mesh = meshkit.make_mesh("data=-1")
    affine = jax.jit(lambda params, a, *, b: params * a + b)
    x, y = _affine_input(n, dtype), _affine_input(n, dtype)[::-1]
    _assert_same(pad_shard_unpad(affine, mesh)(5, x, b=y), affine(5, x, b=y))


def test_pad_shard_unpad_keyword_errors_name_the_fix():
    mesh = meshkit.make_mesh("data=-1")
    affine = jax.jit(lambda params, a, *, b: params * a + b, static_argnames=("b",))
    x = np.ones((3, 2), np.float32)
    expected = r"keyword argument 'b' = 10, a scalar: .* give static_argnames=\('b',\)"
    with pytest.raises(ValueError, match=expected):
        pad_shard_unpad(affine, mesh)(5, x, b=10)
    with pytest.raises(ValueError, match=r"argument 0 = 5, a scalar: .* add 0 to static_argnums"):
        pad_shard_unpad(affine, mesh, static_argnums=())(5, x, b=10)
    with pytest.raises(TypeError, match=r"static_argnames=\('b', 1\), with \[1\] not a string"):
        pad_shard_unpad(affine, mesh, static_argnames=("b", 1))  # pyright: ignore[reportArgumentType]
    masked = pad_shard_unpad(
        jax.jit(lambda a, mask: a), mesh, static_argnums=(), static_return=True, with_mask=True
    )
    with pytest.raises(ValueError, match="passes mask= itself, but the call passed mask= too"):
        masked(x, mask=np.ones(3, bool))


def _batch_axis_mesh() -> jax.sharding.Mesh:
    """A mesh whose rows go over an axis named ``batch``, beside a ``model`` axis."""
    return meshkit.make_mesh(f"model={2 if D % 2 == 0 else 1},batch=-1")


def test_a_data_axis_of_another_name_gives_the_same_results():
    mesh, other = meshkit.make_mesh("data=-1"), _batch_axis_mesh()
    data = arrays(37)
    default = full_eval(per_example, 3.0, data, mesh=mesh, batch_size=16, collect=["pred"])
    named = full_eval(
        per_example, 3.0, data, mesh=other, batch_size=16, collect=["pred"], data_axis="batch"
    )
    assert named.metrics == default.metrics and named.count == default.count == 37
    np.testing.assert_array_equal(named.per_example["pred"], default.per_example["pred"])

    streams = [
        stream_eval(
            lambda _, b: {"x": b["x"]},
            None,
            filtered(100, 8 * jax.local_device_count()),
            mesh=m,
            rows_per_process=8 * jax.local_device_count(),
            data_axis=axis,
        )
        for m, axis in ((mesh, meshkit.DATA_AXIS), (other, "batch"))
    ]
    assert streams[0] == streams[1] and streams[1].count == 66

    identity = jax.jit(lambda x: x)
    x = np.arange(6.0 * 3).reshape(6, 3)
    wrapped = pad_shard_unpad(identity, other, static_argnums=(), data_axis="batch")
    np.testing.assert_array_equal(wrapped(x), pad_shard_unpad(identity, mesh, static_argnums=())(x))
    placed = pad_shard_unpad(
        identity, other, static_argnums=(), static_return=True, data_axis="batch"
    )
    assert placed(x).sharding.spec == jax.P("batch")


def test_a_data_axis_the_mesh_lacks_is_named_in_the_error():
    other = _batch_axis_mesh()
    expected = r"data_axis='data', but the mesh has axes \{'model': \d+, 'batch': \d+\}"
    with pytest.raises(ValueError, match="full_eval got " + expected):
        full_eval(per_example, 3.0, arrays(4), mesh=other, batch_size=B)
    with pytest.raises(ValueError, match="stream_eval got " + expected):
        stream_eval(per_example, 3.0, [arrays(4)], mesh=other, rows_per_process=B)
    with pytest.raises(ValueError, match="pad_shard_unpad got " + expected):
        pad_shard_unpad(jax.jit(lambda x: x), other, static_argnums=())
    with pytest.raises(
        ValueError, match=r"data_axis='rows'.*Pass data_axis=<one of \['model', 'batch'\]>"
    ):
        full_eval(per_example, 3.0, arrays(4), mesh=other, batch_size=B, data_axis="rows")


def test_data_axis_is_for_meshes_only():
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    pipeline = EvalPipeline(ArraySource(arrays(4)), global_batch_size=B, sharding=sharding)
    with pytest.raises(ValueError, match="data_axis='batch' with an EvalPipeline"):
        full_eval(per_example, 3.0, pipeline, data_axis="batch")
    with pytest.raises(ValueError, match="data_axis='batch' and a batch sharding"):
        pad_shard_unpad(jax.jit(lambda x: x), sharding, data_axis="batch")


def filtered(n: int, batch: int):
    x = np.arange(n, dtype=np.float32)
    for start in range(0, n, batch):
        chunk = x[start : start + batch]
        yield {"x": chunk[chunk % 3 != 0]}


@pytest.mark.parametrize("n", [0, 7, 1000])
def test_stream_eval_on_a_filtered_stream(n):
    mesh = meshkit.make_mesh("data=-1")
    rows = 8 * jax.local_device_count()
    kept = [x for x in range(n) if x % 3 != 0]
    template = {"x": np.zeros((0,), np.float32)}
    result = stream_eval(
        lambda _, b: {"x": b["x"]},
        None,
        filtered(n, rows),
        mesh=mesh,
        rows_per_process=rows,
        template=template,
    )
    assert result.count == len(kept)
    batches = -(-n // rows)
    assert result.num_steps == batches + 1 + (batches == 0)  # one extra, all-padding step
    if kept:
        np.testing.assert_allclose(result.metrics["x"], np.mean(kept), rtol=1e-6)
