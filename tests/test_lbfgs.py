"""meshkit.lbfgs against scipy's float64 L-BFGS-B, jaxopt, numpy and itself across meshes.

The data are the JAXopt L-BFGS notebook's kind of problem (``make_classification``
with 10 classes), scaled down so each test takes seconds; the recipe and the benchmark
run the full 50,000 × 784 problem. The solver's arithmetic is checked in one pass (``once``), where
it costs least; what depends on the rows' split over the devices in the 8-device pass
(``once(8)``); ``test_one_and_eight_devices_agree`` ties the two together.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn import datasets
from threadpoolctl import threadpool_limits

import meshkit
from meshkit import lbfgs

ROWS, FEATURES, CLASSES = 3000, 64, 10


@functools.cache
def seed_like(rows: int = ROWS, features: int = FEATURES, classes: int = CLASSES, seed: int = 0):
    x, y = datasets.make_classification(
        n_samples=rows,
        n_features=features,
        n_classes=classes,
        n_informative=min(32, features - 2),
        random_state=seed,
    )
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


def numpy_objective(w, b, x, y, l2):
    """Mean softmax cross-entropy + l2 / 2 ||w||² (not b) and its gradient, in float64."""
    x = x.astype(np.float64)
    z = x @ w + (0.0 if b is None else b)
    top = z.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    rows = np.arange(len(y))
    value = np.mean(lse - z[rows, y]) + 0.5 * l2 * np.sum(w * w)
    p = np.exp(z - lse[:, None])
    p[rows, y] -= 1
    return value, x.T @ p / len(y) + l2 * w, p.mean(axis=0)


@functools.cache
def scipy_optimum(l2: float, intercept: bool) -> tuple[float, np.ndarray]:
    """scipy's float64 L-BFGS-B, run to machine precision: the reference optimum."""
    x, y = seed_like()
    x = x.astype(np.float64)
    size = FEATURES * CLASSES

    def fun(flat):
        w = flat[:size].reshape(FEATURES, CLASSES)
        b = flat[size:] if intercept else None
        value, gw, gb = numpy_objective(w, b, x, y, l2)
        return value, np.concatenate([gw.ravel(), gb if intercept else []])

    start = np.zeros(size + (CLASSES if intercept else 0))
    options = {"maxiter": 10_000, "maxfun": 20_000, "ftol": 1e-15, "gtol": 1e-10}
    with threadpool_limits(1):  # BLAS threads fighting over 2 busy cores are 10x slower
        result = scipy.optimize.minimize(fun, start, jac=True, method="L-BFGS-B", options=options)
    assert np.linalg.norm(result.jac) < 1e-5, result.message
    return float(result.fun), result.x


@pytest.fixture(scope="module")
def mesh():
    return meshkit.make_mesh("data=-1")


@pytest.fixture(scope="module")
def data(mesh):
    return lbfgs.classification_data(*seed_like(), mesh)


def make_solver(mesh, **settings):
    settings = {"l2_mask": lbfgs.l2_except("b"), **settings}
    return lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, **settings)


@pytest.mark.once
@pytest.mark.parametrize(("l2", "intercept"), [(0.0, False), (1e-3, True)])
def test_reaches_scipy_float64_optimum(mesh, data, l2, intercept):
    reference, flat = scipy_optimum(l2, intercept)
    solver = make_solver(mesh, tol=1e-4)
    solution = solver.solve(lbfgs.linear_params(FEATURES, CLASSES, intercept=intercept), data, l2)
    assert solution.status is lbfgs.Status.GRADIENT_TOLERANCE
    assert abs(float(solution.value) - reference) <= 1e-5 * abs(reference)
    # the float32 value agrees with numpy's float64 objective at the returned params
    params = meshkit.to_host(solution.params)
    w, b = (params["w"], params["b"]) if intercept else (params, None)
    value, _, _ = numpy_objective(w.astype(np.float64), b, *seed_like(), l2)
    assert abs(float(solution.value) - value) <= 1e-6 * value
    if l2 > 0:  # strictly convex: the minimiser is unique
        np.testing.assert_allclose(w.ravel(), flat[: w.size], atol=2e-3)
        assert b is not None
        np.testing.assert_allclose(b, flat[w.size :], atol=2e-3)


@pytest.mark.once
def test_no_more_iterations_than_jaxopt(mesh, data):
    import jaxopt

    x, y = seed_like()
    rows = NamedSharding(mesh, P("data"))
    sharded = (jax.device_put(x, rows), jax.device_put(y, rows))  # 3,000 rows: no padding
    seed_solver = jaxopt.LBFGS(
        fun=jaxopt.objective.multiclass_logreg, stepsize=0.0, linesearch="zoom", maxiter=500
    )
    w0 = jnp.zeros((FEATURES, CLASSES))
    _, state = jax.jit(seed_solver.run)(w0, data=sharded)
    solution = make_solver(mesh).solve(lbfgs.linear_params(FEATURES, CLASSES), data)
    assert float(state.error) <= 1e-3 and float(solution.grad_norm) <= 1e-3
    assert int(solution.iterations) <= int(state.iter_num), (
        int(solution.iterations),
        int(state.iter_num),
    )
    assert int(solution.num_evaluations) < int(state.num_fun_eval)
    assert abs(float(solution.value) - float(state.value)) <= 1e-5 * float(state.value)


@pytest.mark.once(8)  # about the rows' split over the devices
def test_objective_is_exact_for_rows_not_divisible_by_devices(mesh):
    x, y = seed_like(rows=50_001, features=8, classes=3)
    data = lbfgs.classification_data(x, y, mesh)
    assert data.num_examples == 50_001 and data.padded_rows % mesh.shape["data"] == 0
    rng = np.random.default_rng(1)
    params = {
        "w": rng.normal(size=(8, 3)).astype(np.float32),
        "b": np.array([0.1, 0, -0.1], np.float32),
    }
    state = make_solver(mesh).init(params, data, 0.5)
    value, gw, gb = numpy_objective(params["w"].astype(np.float64), params["b"], x, y, 0.5)
    np.testing.assert_allclose(float(state.value), value, rtol=2e-6)
    grad = meshkit.to_host(state.grad)
    np.testing.assert_allclose(grad["w"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad["b"], gb, rtol=1e-4, atol=1e-6)


@pytest.mark.once(8)  # about the rows' split over the devices
@pytest.mark.parametrize("gradient_blocks", [1, 7, 64])
def test_gradient_blocks_give_the_exact_objective_and_the_same_solution(mesh, gradient_blocks):
    """The gradient as a sum over row blocks (the GPU layout) against numpy and one block."""
    # 4,990 rows: 2 padded rows on 8 devices, 624 rows per device (6 or 48 blocks of them)
    x, y = seed_like(rows=4_990, features=8, classes=3)
    data = lbfgs.classification_data(x, y, mesh)
    rng = np.random.default_rng(2)
    params = {
        "w": rng.normal(size=(8, 3)).astype(np.float32),
        "b": np.array([0.1, 0, -0.1], np.float32),
    }
    solver = make_solver(mesh, gradient_blocks=gradient_blocks, tol=1e-5)
    state = solver.init(params, data, 0.5)
    value, gw, gb = numpy_objective(params["w"].astype(np.float64), params["b"], x, y, 0.5)
    np.testing.assert_allclose(float(state.value), value, rtol=2e-6)
    grad = meshkit.to_host(state.grad)
    np.testing.assert_allclose(grad["w"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad["b"], gb, rtol=1e-4, atol=1e-6)
    start = lbfgs.linear_params(8, 3, intercept=True)
    blocked = solver.solve(start, data, 1e-4)
    plain = make_solver(mesh, gradient_blocks=1, tol=1e-5).solve(start, data, 1e-4)
    np.testing.assert_allclose(float(blocked.value), float(plain.value), rtol=1e-6)
    np.testing.assert_allclose(
        meshkit.to_host(blocked.params)["w"], meshkit.to_host(plain.params)["w"], atol=1e-3
    )


@pytest.mark.once
def test_inverse_hessian_product_matches_the_two_loop_recursion():
    """The compact form of the product, against the textbook recursion in float64 numpy."""
    from meshkit.lbfgs._lbfgs import inverse_hessian_product

    rng = np.random.default_rng(1)
    m, n = 5, 7
    for num_pairs, newest in [(0, 4), (1, 2), (3, 0), (5, 3)]:
        s_rows = rng.normal(size=(m, n)).astype(np.float32)
        y_rows = (s_rows + 0.3 * rng.normal(size=(m, n))).astype(np.float32)
        v = rng.normal(size=n).astype(np.float32)
        unused: Any = None  # the product reads only the history fields
        state = lbfgs.LBFGSState(
            params=unused, value=unused, grad=unused,
            s_history={"a": s_rows[:, :3], "b": s_rows[:, 3:]},
            y_history={"a": y_rows[:, :3], "b": y_rows[:, 3:]},
            sy_products=jnp.asarray(s_rows @ y_rows.T),
            yy_products=jnp.asarray(y_rows @ y_rows.T),
            newest=jnp.int32(newest), num_pairs=jnp.int32(num_pairs), step_size=unused,
            iteration=unused, num_evaluations=unused, status=unused, value_history=unused,
            grad_norm_history=unused,
        )  # fmt: skip
        product = inverse_hessian_product(state, {"a": v[:3], "b": v[3:]})
        got = np.concatenate([product["a"], product["b"]])
        ages = [(newest - age) % m for age in range(num_pairs)]  # newest first
        s_rows, y_rows = s_rows.astype(np.float64), y_rows.astype(np.float64)
        q, alphas = v.astype(np.float64), []
        for k in ages:
            alphas.append(s_rows[k] @ q / (s_rows[k] @ y_rows[k]))
            q -= alphas[-1] * y_rows[k]
        gamma = s_rows[newest] @ y_rows[newest] / (y_rows[newest] @ y_rows[newest])
        r = (gamma if num_pairs else 1.0) * q
        for k, alpha in zip(reversed(ages), reversed(alphas), strict=True):
            r += (alpha - y_rows[k] @ r / (s_rows[k] @ y_rows[k])) * s_rows[k]
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(8)
def test_padded_on_8_devices_agrees_with_unpadded_on_1(mesh):
    x, y = seed_like(rows=50_001, features=8, classes=3)
    one = meshkit.make_mesh("data=-1", devices=jax.devices()[:1])
    solutions = []
    for m in (mesh, one):
        solver = make_solver(m, tol=1e-5)
        start = lbfgs.linear_params(8, 3, intercept=True)
        solutions.append(solver.solve(start, lbfgs.classification_data(x, y, m), 1e-4))
    assert solutions[0].status is solutions[1].status is lbfgs.Status.GRADIENT_TOLERANCE
    np.testing.assert_allclose(float(solutions[0].value), float(solutions[1].value), rtol=1e-6)
    params = [meshkit.to_host(s.params) for s in solutions]
    np.testing.assert_allclose(params[0]["w"], params[1]["w"], atol=1e-3)


@pytest.mark.devices(8)
def test_one_and_eight_devices_agree(mesh, data):
    one = meshkit.make_mesh("data=-1", devices=jax.devices()[:1])
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    eight = make_solver(mesh, tol=1e-4).solve(start, data, 1e-3)
    single = make_solver(one, tol=1e-4).solve(
        start, lbfgs.classification_data(*seed_like(), one), 1e-3
    )
    np.testing.assert_allclose(float(eight.value), float(single.value), rtol=1e-6)
    np.testing.assert_allclose(
        meshkit.to_host(eight.params)["w"], meshkit.to_host(single.params)["w"], atol=2e-3
    )


@pytest.mark.once(8)  # about the rows' split over the devices
def test_nan_on_padded_rows_does_not_leak(mesh):
    """A loss that is -inf on padded rows: ``where`` drops it, ``loss * mask`` would give nan."""
    real, padded = 40, 48  # 48 rows divide over 1, 2, 4 or 8 devices
    rng = np.random.default_rng(0)
    x = rng.normal(size=(padded, 3)).astype(np.float32)
    weight = (np.arange(padded) < real).astype(np.float32)  # 0 on the padding
    rows = NamedSharding(mesh, P("data"))
    data = lbfgs.Dataset(
        batch=jax.device_put({"x": x, "weight": weight}, rows),
        mask=jax.device_put(np.arange(padded) < real, rows),
        num_examples=real,
    )

    def loss(w, batch):  # log(0) = -inf on the padded rows
        return (batch["x"] @ w - 1.0) ** 2 + jnp.log(batch["weight"])

    with np.errstate(divide="ignore", invalid="ignore"):  # the trap: -inf * 0 is nan
        assert np.isnan(np.sum(np.log(weight) * (np.arange(padded) < real)))
    state = lbfgs.LBFGS(loss, mesh).init(np.zeros(3, np.float32), data)
    expected = np.mean((x[:real].astype(np.float64) @ np.zeros(3) - 1.0) ** 2)
    np.testing.assert_allclose(float(state.value), expected, rtol=1e-6)
    assert np.isfinite(meshkit.to_host(state.grad)).all()


@pytest.mark.once
def test_nonfinite_start_gives_status_and_throw(mesh):
    x = np.ones((16, 2), np.float32)
    x[3, 1] = np.nan  # a bad real row
    data = lbfgs.shard_dataset({"x": x}, mesh)
    solver = lbfgs.LBFGS(lambda w, batch: (batch["x"] @ w) ** 2, mesh)
    solution = solver.solve(np.zeros(2, np.float32), data, throw=False)
    assert solution.status is lbfgs.Status.NONFINITE
    assert int(solution.iterations) == 0 and not solution.succeeded
    with pytest.raises(lbfgs.LBFGSError) as info:
        solver.solve(np.zeros(2, np.float32), data)
    message = str(info.value)
    assert "NONFINITE" in message and "not finite" in message and "Check the loss" in message
    assert info.value.solution.status is lbfgs.Status.NONFINITE


@jax.custom_vjp
def _wrong_gradient(w):
    return jnp.sum((w - 1.0) ** 2)


_wrong_gradient.defvjp(lambda w: (_wrong_gradient(w), w), lambda w, g: (-2 * g * (w - 1.0),))


@pytest.mark.once
def test_wrong_gradient_gives_linesearch_failure(mesh):
    data = lbfgs.shard_dataset({"x": np.ones((8, 1), np.float32)}, mesh)
    solver = lbfgs.LBFGS(lambda w, batch: batch["x"][:, 0] * _wrong_gradient(w), mesh)
    solution = solver.solve(np.zeros(2, np.float32), data, throw=False)
    assert solution.status is lbfgs.Status.LINESEARCH_FAILED
    assert "gradient may not match the objective" in solution.message
    np.testing.assert_array_equal(meshkit.to_host(solution.params), [0.0, 0.0])  # not moved


def _quadratic_problem(mesh):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32) * np.geomspace(1, 30, 6).astype(np.float32)
    data = lbfgs.shard_dataset({"x": x, "y": x @ np.ones(6, np.float32)}, mesh)
    return data, (lambda w, batch: (batch["x"] @ w - batch["y"]) ** 2)


@pytest.mark.once
def test_unbounded_objective_is_named_and_a_far_minimum_is_not(mesh):
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    data = lbfgs.shard_dataset({"x": x}, mesh)
    start = np.zeros(3, np.float32)
    linear = lbfgs.LBFGS(lambda w, b: -(b["x"] @ w), mesh, max_steps=50)
    solution = linear.solve(start, data, throw=False)
    assert solution.status is lbfgs.Status.UNBOUNDED and int(solution.iterations) <= 2
    with pytest.raises(lbfgs.LBFGSError, match=r"UNBOUNDED.*unbounded below.*l2 > 0"):
        linear.solve(start, data)
    # A minimum 1e4 away: a long extrapolation from the first step, but bounded.
    far = lbfgs.LBFGS(lambda w, b: jnp.sum((w - 1e4) ** 2) * jnp.ones(len(b["x"])), mesh)
    found = far.solve(start, data, throw=False)
    assert found.status is lbfgs.Status.GRADIENT_TOLERANCE
    np.testing.assert_allclose(meshkit.to_host(found.params), 1e4, rtol=1e-6)


@pytest.mark.once
def test_no_rows(mesh):
    with pytest.raises(ValueError, match=r"0 examples.*at least one row"):
        lbfgs.classification_data(np.zeros((0, 3)), np.zeros(0, np.int32), mesh)


@pytest.mark.once
def test_max_steps_and_relative_decrease(mesh):
    data, loss = _quadratic_problem(mesh)
    start = np.zeros(6, np.float32)
    short = lbfgs.LBFGS(loss, mesh, max_steps=2, tol=1e-6)
    solution = short.solve(start, data, throw=False)
    assert solution.status is lbfgs.Status.MAX_STEPS and int(solution.iterations) == 2
    with pytest.raises(lbfgs.LBFGSError, match=r"MAX_STEPS after 2 iterations.*raise max_steps"):
        short.solve(start, data)
    loose = lbfgs.LBFGS(loss, mesh, rtol=0.5, tol=1e-6)
    solution = loose.solve(start, data)
    assert solution.status is lbfgs.Status.RELATIVE_DECREASE and solution.succeeded


@pytest.mark.once
def test_one_compile_for_new_data_strengths_and_equal_solvers(mesh):
    x, y = seed_like()
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    first = lbfgs.classification_data(x, y, mesh)
    second = lbfgs.classification_data(x[::-1].copy(), y[::-1].copy(), mesh)  # new data
    with meshkit.count_compiles() as log:
        a = make_solver(mesh, max_steps=77).solve(start, first, 1e-3, throw=False)
        b = make_solver(mesh, max_steps=77).solve(start, second, 2e-3, throw=False)
        c = make_solver(mesh, max_steps=77).solve(start, first, 4e-3, throw=False)
    assert log.count() == 1, log.events  # one program, whatever the data and the strength
    assert len({float(s.value) for s in (a, b, c)}) == 3


@pytest.mark.once  # the same at any device count
def test_grid_of_strengths_in_one_program(mesh, data):
    x, y = seed_like()
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    second = lbfgs.classification_data(x[::-1].copy(), y[::-1].copy(), mesh)
    solver = make_solver(mesh)
    with meshkit.count_compiles() as log:
        path = solver.solve_many(start, data, [1e-3, 2e-3, 4e-3, 8e-3])
        again = solver.solve_many(start, second, [1e-2, 2e-2, 4e-2, 8e-2])
    assert log.count() == 1, log.events
    assert path.statuses == [lbfgs.Status.GRADIENT_TOLERANCE] * 4 and again.succeeded
    values = meshkit.to_host(path.value)
    assert np.all(np.diff(values) > 0)  # more regularisation, higher optimum
    single = solver.solve(start, data, 4e-3)
    np.testing.assert_allclose(values[2], float(single.value), rtol=1e-5)


@pytest.mark.once
def test_checkpoint_mid_solve_reproduces_the_trajectory(mesh, data, tmp_path):
    solver = make_solver(mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    initial = solver.init(start, data, 1e-3)
    whole = solver.run(initial, data, 1e-3)

    half = solver.run(initial, data, 1e-3, num_steps=7)
    assert int(half.iteration) == 7 and not bool(solver.terminate(half)[0])
    leaves, treedef = jax.tree.flatten(meshkit.to_host(half))
    np.savez(tmp_path / "state.npz", *leaves)
    with np.load(tmp_path / "state.npz") as saved:
        loaded = jax.tree.unflatten(treedef, [saved[f"arr_{i}"] for i in range(len(leaves))])
    resumed = solver.run(solver.load_state(loaded), data, 1e-3)
    pairs = zip(jax.tree.leaves(meshkit.to_host(resumed)), jax.tree.leaves(whole), strict=True)
    for got, want in pairs:
        np.testing.assert_array_equal(got, meshkit.to_host(want))  # bit for bit
    assert solver.solution(resumed).status is lbfgs.Status.GRADIENT_TOLERANCE


@pytest.mark.once
def test_step_by_step_then_run(mesh, data):
    solver = make_solver(mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    stepped = solver.init(start, data, 1e-3)
    values = []
    for _ in range(5):  # the step-wise API, e.g. for a callback per iteration
        stepped = solver.step(stepped, data, 1e-3)
        values.append(float(stepped.value))  # reading it keeps one step in flight
    assert int(stepped.iteration) == 5 and values == sorted(values, reverse=True)
    finished = solver.solution(solver.run(stepped, data, 1e-3), throw=True)
    assert finished.status is lbfgs.Status.GRADIENT_TOLERANCE
    solved = solver.solve(start, data, 1e-3)
    np.testing.assert_allclose(float(finished.value), float(solved.value), rtol=1e-6)
    done = solver.init(solved.params, data, 1e-3)  # already converged
    assert bool(solver.terminate(done)[0])
    unchanged = solver.step(done, data, 1e-3)  # a finished state does not move
    assert int(unchanged.iteration) == 0 and int(unchanged.num_evaluations) == 1


@pytest.mark.once
def test_warm_start(mesh, data):
    solver = make_solver(mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    cold = solver.solve(start, data, 1e-3)
    again = solver.solve(cold.params, data, 1e-3)
    assert int(again.iterations) == 0 and again.status is lbfgs.Status.GRADIENT_TOLERANCE
    nearby_cold = solver.solve(start, data, 1.2e-3)
    nearby_warm = solver.solve(cold.params, data, 1.2e-3)
    assert int(nearby_warm.iterations) < int(nearby_cold.iterations)
    np.testing.assert_allclose(float(nearby_warm.value), float(nearby_cold.value), rtol=1e-5)


@pytest.mark.once(8)  # about the rows' split over the devices
def test_state_keeps_shapes_dtypes_and_shardings(mesh, data):
    solver = make_solver(mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    state = solver.init(start, data, 1e-3)
    stepped = solver.step(state, data, 1e-3)
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(stepped), strict=True):
        assert before.shape == after.shape and before.dtype == after.dtype
        assert before.sharding.is_equivalent_to(after.sharding, before.ndim)
        assert after.sharding.is_fully_replicated
    assert state.s_history["w"].shape == (solver.history_size, FEATURES, CLASSES)
    solution = solver.solution(stepped)
    assert solution.params["w"].dtype == jnp.float32
    done, code = solver.terminate(stepped)
    assert not bool(done) and int(code) == 0


@pytest.mark.once
def test_history_for_plots(mesh, data):
    solver = make_solver(mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    initial = solver.init(start, data, 1e-3)
    solution = solver.solve(start, data, 1e-3)
    history = solution.history()
    n = int(solution.iterations)
    assert history["value"].shape == history["grad_norm"].shape == (n + 1,)
    np.testing.assert_allclose(history["value"][0], float(initial.value), rtol=1e-6)
    np.testing.assert_allclose(history["grad_norm"][-1], float(solution.grad_norm), rtol=1e-5)
    assert np.all(np.diff(history["value"]) <= 1e-6 * history["value"][:-1])  # descent
    assert np.isnan(meshkit.to_host(solution.value_history)[n + 1 :]).all()
    assert solution.value_history.shape == (solver.max_steps + 1,)


@pytest.mark.devices(8)
def test_parameters_sharded_over_a_model_axis(data):
    model_mesh = meshkit.make_mesh("data=4,model=2")
    rules = meshkit.PartitionRules([("w", P(None, "model"))])
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    sharded = make_solver(model_mesh, param_rules=rules).solve(
        start, lbfgs.classification_data(*seed_like(), model_mesh), 1e-3
    )
    assert sharded.params["w"].sharding.spec == P(None, "model")
    replicated = make_solver(data.mask.sharding.mesh).solve(start, data, 1e-3)
    np.testing.assert_allclose(float(sharded.value), float(replicated.value), rtol=1e-5)


@pytest.mark.once(8)  # about the rows' split over the devices
def test_explicit_axes_match_auto_axes(data):
    explicit = meshkit.make_mesh("data=-1", axis_types=AxisType.Explicit)
    start = lbfgs.linear_params(FEATURES, CLASSES, intercept=True)
    a = make_solver(explicit).solve(start, lbfgs.classification_data(*seed_like(), explicit), 1e-3)
    b = make_solver(data.mask.sharding.mesh).solve(start, data, 1e-3)
    np.testing.assert_allclose(float(a.value), float(b.value), rtol=1e-6)


# ---- bad input: the error names what it got, what it expected, and the fix ----


@pytest.mark.once
def test_mismatched_rows(mesh):
    with pytest.raises(ValueError, match=r"x has 5 rows but y has 4 labels; expected one label"):
        lbfgs.classification_data(np.ones((5, 2)), np.zeros(4, int), mesh)
    with pytest.raises(ValueError, match=r"different numbers of rows: \{\"\['a'\]\": 3"):
        lbfgs.shard_dataset({"a": np.ones(3), "b": np.ones(4)}, mesh)


@pytest.mark.once
@pytest.mark.parametrize(
    ("labels", "got"), [([0, 1, 10], "got 10 at row 2"), ([-1, 0, 1], "got -1 at row 0")]
)
def test_labels_out_of_range(mesh, labels, got):
    with pytest.raises(ValueError, match=r"Labels must lie in \[0, 10\)") as info:
        lbfgs.classification_data(np.ones((3, 2)), np.array(labels), mesh, num_classes=10)
    assert got in str(info.value) and "np.unique(y, return_inverse=True)" in str(info.value)
    with pytest.raises(TypeError, match=r"integer class labels, got dtype float64.*astype"):
        lbfgs.classification_data(np.ones((3, 2)), np.array([0.0, 1.0, 2.0]), mesh)


def test_mesh_without_data_axis():
    model_only = meshkit.make_mesh("model=-1")
    for build in (
        lambda: lbfgs.LBFGS(lbfgs.multiclass_logreg, model_only),
        lambda: lbfgs.shard_dataset({"x": np.ones((4, 2))}, model_only),
    ):
        with pytest.raises(ValueError) as info:
            build()
        message = str(info.value)
        assert "none is named 'data'" in message and "'model'" in message
        assert "meshkit.make_mesh('data=-1')" in message
    with pytest.raises(TypeError, match=r"needs a jax.sharding.Mesh, got str"):
        lbfgs.LBFGS(lbfgs.multiclass_logreg, "data=-1")  # type: ignore[arg-type]


@pytest.mark.once
def test_parameters_that_do_not_fit_the_data(mesh, data):
    solver = make_solver(mesh)
    with pytest.raises(ValueError) as info:
        solver.solve(np.zeros((FEATURES + 1, CLASSES), np.float32), data)
    message = str(info.value)
    assert (
        f"float32[{FEATURES + 1}, {CLASSES}]" in message and f"float32[3000, {FEATURES}]" in message
    )
    assert "Check the shapes of the starting parameters" in message
    with pytest.raises(TypeError, match=r"Parameter \['w'\] has dtype int64.*np.zeros"):
        solver.solve({"w": np.zeros((FEATURES, CLASSES), np.int64), "b": np.zeros(10)}, data)
    with pytest.raises(TypeError, match=r"has dtype bfloat16; L-BFGS keeps its iterates"):
        solver.solve({"w": jnp.zeros((FEATURES, CLASSES), jnp.bfloat16), "b": np.zeros(10)}, data)


@pytest.mark.once
def test_loss_returning_a_mean_and_other_mistakes(mesh, data):
    mean_loss = lbfgs.LBFGS(lambda w, b: jnp.mean(lbfgs.multiclass_logreg(w, b)), mesh)
    with pytest.raises(ValueError, match=r"one loss per example, shape \(3000,\).*got \(\)"):
        mean_loss.solve(np.zeros((FEATURES, CLASSES), np.float32), data)
    solver = make_solver(mesh)
    with pytest.raises(
        TypeError, match=r"expects a meshkit.lbfgs.Dataset, got dict.*shard_dataset"
    ):
        solver.solve(np.zeros((FEATURES, CLASSES), np.float32), {"x": 1})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"l2 must be a scalar, got shape \(2,\).*solve_many"):
        solver.solve(np.zeros((FEATURES, CLASSES), np.float32), data, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"0 < c1 < c2 < 1.*c1=0.5, c2=0.1"):
        lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, c1=0.5, c2=0.1)
    with pytest.raises(ValueError, match=r"max_steps must be an int >= 1, got 0"):
        lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, max_steps=0)


@pytest.mark.devices(8)
def test_data_from_another_mesh(data):
    half = meshkit.make_mesh("data=-1", devices=jax.devices()[:4])
    with pytest.raises(
        ValueError, match=r"expects rows split over 'data' of its mesh \{'data': 4\}"
    ):
        make_solver(half).solve(np.zeros((FEATURES, CLASSES), np.float32), data)


@pytest.mark.once  # the recipe picks its own 8 devices
def test_recipe_smoke(tmp_path):
    """The recipe end to end on a small problem, in a process of its own (it initialises JAX)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "recipes.lbfgs", "--num-samples", "2001"]
    command += ["--num-features", "60", "--maxiter", "8", "--workdir", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = summary["runs"]
    assert [run["iterations"] for run in runs.values()] == [8, 8]
    assert summary["max_relative_value_difference"] < 1e-5
    assert "ratio of total times, single device / sharded" in out.stdout
    assert (tmp_path / "grad_norm.png").stat().st_size > 0
    assert (tmp_path / "step_time.png").stat().st_size > 0


def _zakharov(x):
    i = jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)
    weighted = jnp.sum(0.5 * i * x)
    return jnp.sum(x**2) + weighted**2 + weighted**4


def _steep(x):  # a quadratic of curvature 1e8 (jax-ml/jax#4594)
    return jnp.mean((1e4 * x) ** 2)


def _optax_iterations(fun, x0, tol):
    """optax.lbfgs stepped in a jitted while_loop, as optax's own tests run it."""
    import optax

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(fun)

    def cond(carry):
        _, state, count = carry
        norm = optax.tree.norm(optax.tree.get(state, "grad"))
        return (count == 0) | ((norm >= tol) & (count < 500))

    def body(carry):
        x, state, count = carry
        value, grad = value_and_grad(x, state=state)
        updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
        return optax.apply_updates(x, updates), state, count + 1

    run = jax.jit(lambda x: jax.lax.while_loop(cond, body, (x, opt.init(x), 0)))
    return int(run(x0)[2])


@pytest.mark.once  # one parameter vector: the same at any device count
@pytest.mark.parametrize(
    ("name", "fun", "start"),
    [
        ("zakharov", _zakharov, [600.0, 700.0, 200.0, 100.0, 90.0, 1e3]),
        ("steep", _steep, [1.0, 1.0]),
    ],
)
def test_the_peers_hard_problems_are_solved_in_as_few_iterations(name, fun, start):
    """optax's and jaxopt's own L-BFGS tests: Zakharov from far away (a quartic term of
    1e14) and a quadratic of curvature 1e8. Both minima are 0 at x = 0."""
    import jaxopt

    tol = 1e-5
    mesh = meshkit.make_mesh("data=-1")
    data = lbfgs.shard_dataset({"one": np.ones((1,), np.float32)}, mesh)
    solver = lbfgs.LBFGS(lambda x, batch: batch["one"] * fun(x), mesh, tol=tol)
    x0 = jnp.asarray(start, jnp.float32)
    solution = solver.solve(x0, data)
    assert solution.status is lbfgs.Status.GRADIENT_TOLERANCE, solution.message
    np.testing.assert_allclose(meshkit.to_host(solution.params), 0.0, atol=1e-5)
    assert float(solution.value) <= 1e-5
    peers = {
        "optax": _optax_iterations(fun, x0, tol),
        "jaxopt": int(jax.jit(jaxopt.LBFGS(fun=fun, tol=tol, maxiter=500).run)(x0).state.iter_num),
    }
    assert int(solution.iterations) <= max(peers.values()), (int(solution.iterations), peers)
