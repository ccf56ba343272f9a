"""The JAXopt L-BFGS notebook: its jaxopt loop, ported, against meshkit.lbfgs on 8 devices.

    python -m benchmarks.lbfgs        # or: python -m benchmarks lbfgs

On 8 fake CPU devices (mesh ``data=8``) and the seed's data (``make_classification``,
50,000 × 784, 10 classes, 50 informative, ``random_state=0``), from zero weights to a
gradient norm of at most 1e-3 (jaxopt's default ``tol``), interleaved A B, B A, ...:

- the JAXopt notebook's program with the smallest change that runs today: ``jaxopt.LBFGS(fun=
  multiclass_logreg, stepsize=0.0, linesearch="zoom")``, ``update`` under ``jax.jit``
  with the data on ``P('data')`` (the seed's ``pjit``), the state from ``init_state``,
  and the notebook's Python loop that blocks on every step and reads ``state.error``
  (at most one step in flight; it stops at the tolerance instead of after 100 steps);
- ``meshkit.lbfgs.LBFGS(...).solve``: one jitted program, one dispatch, its defaults
  (``history_size=20, c2=0.5``);
- the same with jaxopt's settings (``history_size=10, c2=0.9``), to show what the
  defaults buy.

Reported: the ratio of total times (compile excluded; compile times separately),
iterations and evaluations, compile counts for repeated solves on new data and for a
sweep and a grid of strengths, the final objective against scipy's float64 L-BFGS-B
optimum, time per iteration at 10k, 20k and 40k rows, and peak memory (process RSS:
on the CPU backend ``Device.memory_stats()`` is ``None``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxopt  # noqa: E402
import numpy as np  # noqa: E402
import scipy.optimize  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn import datasets  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from benchmarks._harness import interleave, report, save  # noqa: E402
from meshkit import lbfgs  # noqa: E402

ROWS, FEATURES, CLASSES = 50_000, 784, 10
TOL = 1e-3
ROUNDS = 5
SCALING_ROWS = (10_000, 20_000, 40_000)
SCALING_STEPS = 25


def seed_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = datasets.make_classification(
        n_samples=rows, n_features=FEATURES, n_classes=CLASSES, n_informative=50, random_state=seed
    )
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


def peak_rss_mib() -> float:
    """This process's peak resident memory since the last ``reset_peak_rss`` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class SeedLoop:
    """The notebook's ``fit`` loop, ported: jit instead of the removed pjit, P('data') data."""

    def __init__(self, data: tuple[jax.Array, jax.Array]):
        self.data = data
        self.solver = jaxopt.LBFGS(
            fun=jaxopt.objective.multiclass_logreg, stepsize=0.0, linesearch="zoom"
        )
        self.update = jax.jit(self.solver.update)
        self.errors: list[float] = []
        self.state: Any = None

    def __call__(self) -> None:
        params = jnp.zeros([FEATURES, CLASSES])
        state = self.solver.init_state(params, data=self.data)
        errors = []
        for _ in range(500):
            params, state = self.update(params, state, self.data)
            jax.tree.map(lambda t: t.block_until_ready(), (params, state))  # as the seed
            errors.append(state.error.item())
            if errors[-1] <= TOL:
                break
        self.errors, self.state = errors, state


def scipy_reference(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """scipy's float64 L-BFGS-B optimum of the same objective; returns (value, seconds)."""
    x64, rows = x.astype(np.float64), np.arange(len(y))

    def fun(flat: np.ndarray) -> tuple[float, np.ndarray]:
        z = x64 @ flat.reshape(FEATURES, CLASSES)
        top = z.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
        p = np.exp(z - lse[:, None])
        p[rows, y] -= 1
        return float(np.mean(lse - z[rows, y])), (x64.T @ p / len(y)).ravel()

    start = time.perf_counter()
    with threadpool_limits(1):  # BLAS threads fighting over two busy cores are far slower
        result = scipy.optimize.minimize(
            fun,
            np.zeros(FEATURES * CLASSES),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 5000, "ftol": 1e-14, "gtol": 1e-8},
        )
    return float(result.fun), time.perf_counter() - start


def compile_counts(mesh, data, start) -> dict[str, Any]:
    """Compiles of repeated solves: new data of the same shape, a sweep, a grid."""
    other = lbfgs.classification_data(*seed_data(ROWS, seed=1), mesh)
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, max_steps=501)  # a fresh program
    with meshkit.count_compiles() as solves:
        solver.solve(start, data, throw=False)
        solver.solve(start, other, throw=False)  # new data, same shape
        for l2 in (1e-4, 1e-3, 1e-2):  # a sweep of strengths
            solver.solve(start, data, l2, throw=False)
    with meshkit.count_compiles() as grid:
        path = solver.solve_many(start, data, [1e-4, 1e-3, 1e-2, 1e-1], throw=False)
        jax.block_until_ready(path)
        solver.solve_many(start, other, [2e-4, 2e-3, 2e-2, 2e-1], throw=False)
    return {
        "solves": 5,
        "solve_compiles": solves.count(),
        "grid_solves": 2,
        "grid_compiles": grid.count(),
        "grid_iterations": meshkit.to_host(path.iterations).tolist(),
    }


def scaling(mesh) -> dict[int, dict[str, float]]:
    """meshkit's time per iteration at several row counts (a fixed number of iterations)."""
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=0.0, max_steps=SCALING_STEPS)
    start = lbfgs.linear_params(FEATURES, CLASSES)
    rows_out = {}
    for rows in SCALING_ROWS:
        data = lbfgs.classification_data(*seed_data(rows), mesh)
        jax.block_until_ready(solver.solve(start, data, throw=False))  # compile
        times, solution = [], None
        for _ in range(3):
            begin = time.perf_counter()
            solution = jax.block_until_ready(solver.solve(start, data, throw=False))
            times.append(time.perf_counter() - begin)
        assert solution is not None
        iterations = int(solution.iterations)
        rows_out[rows] = {
            "iterations": iterations,
            "evaluations": int(solution.num_evaluations),
            "median_s": float(np.median(times)),
            "ms_per_iteration": 1e3 * float(np.median(times)) / iterations,
            "ms_per_evaluation": 1e3 * float(np.median(times)) / int(solution.num_evaluations),
        }
        per_eval = rows_out[rows]["evaluations"] / iterations
        print(
            f"  {rows:>6} rows: {rows_out[rows]['ms_per_iteration']:.1f} ms/iteration, "
            f"{rows_out[rows]['ms_per_evaluation']:.1f} ms/evaluation "
            f"({per_eval:.2f} evaluations/iteration)",
            flush=True,
        )
    return rows_out


def main() -> None:
    mesh = meshkit.make_mesh("data=-1")
    x, y = seed_data(ROWS)
    rows = NamedSharding(mesh, P("data"))
    seed_loop = SeedLoop((jax.device_put(x, rows), jax.device_put(y, rows)))
    data = lbfgs.classification_data(x, y, mesh)
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL)
    like_jaxopt = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL, history_size=10, c2=0.9)
    start = lbfgs.linear_params(FEATURES, CLASSES)
    solutions: dict[str, lbfgs.Solution] = {}

    def solve_with(name: str, solver: lbfgs.LBFGS):
        def run() -> None:
            solutions[name] = jax.block_until_ready(solver.solve(start, data, throw=False))

        return run

    run_meshkit = solve_with("meshkit", solver)
    run_like_jaxopt = solve_with("like_jaxopt", like_jaxopt)

    # First calls: compile time (peak memory is measured in fresh processes, below).
    first = {}
    for name, run in (
        ("seed", seed_loop),
        ("meshkit", run_meshkit),
        ("like_jaxopt", run_like_jaxopt),
    ):
        with meshkit.count_compiles() as log:
            begin = time.perf_counter()
            run()
            seconds = time.perf_counter() - begin
        first[name] = {
            "first_call_s": seconds,
            "compile_s": log.seconds(),
            "compiles": log.count(),
        }
    candidates = {
        "notebook jaxopt loop (ported)": seed_loop,
        "meshkit.lbfgs solve": run_meshkit,
        "meshkit, m=10 c2=0.9 (jaxopt's)": run_like_jaxopt,
    }
    timings = interleave(candidates, rounds=ROUNDS, warmup=1)
    title = (
        f"L-BFGS to ||g|| <= {TOL}: {ROWS:,} x {FEATURES} x {CLASSES}, "
        f"{jax.device_count()} devices, {ROUNDS} rounds interleaved (compile excluded)"
    )
    result = report(title, timings, baseline="notebook jaxopt loop (ported)")
    base, mine, alike = (timings[name] for name in candidates)
    ours, theirs = solutions["meshkit"], solutions["like_jaxopt"]
    reference, scipy_s = scipy_reference(x, y)

    result.update(
        ratio_of_totals_meshkit_over_seed=mine.total / base.total,
        ratio_of_totals_jaxopt_settings_over_seed=alike.total / base.total,
        seed={
            "iterations": int(seed_loop.state.iter_num),
            "evaluations": int(seed_loop.state.num_fun_eval),
            "final_grad_norm": seed_loop.errors[-1],
            "value": float(seed_loop.state.value),
            **first["seed"],
        },
        meshkit={
            "iterations": int(ours.iterations),
            "evaluations": int(ours.num_evaluations),
            "final_grad_norm": float(ours.grad_norm),
            "value": float(ours.value),
            "status": ours.status.name,
            **first["meshkit"],
        },
        meshkit_jaxopt_settings={
            "iterations": int(theirs.iterations),
            "evaluations": int(theirs.num_evaluations),
            "final_grad_norm": float(theirs.grad_norm),
            "value": float(theirs.value),
            **first["like_jaxopt"],
        },
        scipy={"value": reference, "seconds": scipy_s},
        relative_gap_to_scipy=(float(ours.value) - reference) / reference,
    )
    print(
        f"\nratio of totals meshkit / seed loop: {result['ratio_of_totals_meshkit_over_seed']:.3f} "
        f"(with jaxopt's m and c2: {result['ratio_of_totals_jaxopt_settings_over_seed']:.3f})"
        f"\niterations to ||g|| <= {TOL}: meshkit {result['meshkit']['iterations']} "
        f"(jaxopt's m and c2: {result['meshkit_jaxopt_settings']['iterations']}), "
        f"seed loop {result['seed']['iterations']}; evaluations meshkit "
        f"{result['meshkit']['evaluations']} ({result['meshkit_jaxopt_settings']['evaluations']}), "
        f"seed loop {result['seed']['evaluations']} (jaxopt's count: each line search also "
        "re-evaluates the value at its start)"
        f"\ncompile: meshkit {first['meshkit']['compile_s']:.2f} s "
        f"({first['meshkit']['compiles']} program), seed loop {first['seed']['compile_s']:.2f} s "
        f"({first['seed']['compiles']} programs)"
        f"\nfinal objective: meshkit {float(ours.value):.7f}, scipy float64 {reference:.7f} "
        f"(relative gap {result['relative_gap_to_scipy']:.1e}; scipy took {scipy_s:.1f} s)"
    )
    result["compile_counts"] = compile_counts(mesh, data, start)
    counts = result["compile_counts"]
    print(
        f"compiles: {counts['solve_compiles']} for {counts['solves']} solves (new data, "
        f"3 strengths); {counts['grid_compiles']} for {counts['grid_solves']} grids of 4"
    )
    print(f"\nmeshkit time per iteration ({SCALING_STEPS} iterations, 8 devices):")
    result["scaling"] = scaling(mesh)
    result["peak_memory"] = peak_memory()
    save("lbfgs", result)


def peak_memory() -> dict[str, Any]:
    """Peak RSS of a first solve (compile included), each candidate in a fresh process."""
    import json
    import subprocess
    import sys

    out: dict[str, Any] = {
        "measure": "VmHWM (peak resident set) of a fresh process, reset after the data "
        "are placed; Device.memory_stats() is None on the CPU backend"
    }
    for name in ("seed", "meshkit"):
        command = [sys.executable, "-m", "benchmarks.lbfgs", "--peak-memory", name]
        line = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        out[name] = json.loads(line.strip().splitlines()[-1])
    print(
        f"\npeak RSS (fresh process, one first solve incl. compile): seed loop "
        f"{out['seed']['peak_mib']:.0f} MiB (+{out['seed']['growth_mib']:.0f} MiB over the "
        f"{out['seed']['before_mib']:.0f} MiB with the data placed), meshkit "
        f"{out['meshkit']['peak_mib']:.0f} MiB (+{out['meshkit']['growth_mib']:.0f} MiB over "
        f"{out['meshkit']['before_mib']:.0f} MiB)"
    )
    return out


def measure_one(name: str) -> None:
    """Runs one candidate's first solve in this (fresh) process and prints its peak RSS."""
    import json

    mesh = meshkit.make_mesh("data=-1")
    x, y = seed_data(ROWS)
    if name == "seed":
        rows = NamedSharding(mesh, P("data"))
        run: Any = SeedLoop((jax.device_put(x, rows), jax.device_put(y, rows)))
    else:
        data = lbfgs.classification_data(x, y, mesh)
        solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL)
        start = lbfgs.linear_params(FEATURES, CLASSES)

        def solve_once() -> None:
            jax.block_until_ready(solver.solve(start, data, throw=False))

        run = solve_once
    del x, y
    reset = reset_peak_rss()
    before = peak_rss_mib()
    run()
    peak = peak_rss_mib()
    print(
        json.dumps(
            {"before_mib": before, "peak_mib": peak, "growth_mib": peak - before, "reset": reset}
        )
    )


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--peak-memory":
        measure_one(sys.argv[2])
    else:
        main()
