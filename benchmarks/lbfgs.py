"""L-BFGS to a gradient tolerance: meshkit.lbfgs against jaxopt, optax and the notebook's loop.

    python -m benchmarks.lbfgs        # or: python -m benchmarks lbfgs

On 8 fake CPU devices (mesh ``data=8``), multinomial logistic regression from zero
weights to a gradient norm of at most 1e-3 (jaxopt's default ``tol``), on three
problems: the JAXopt notebook's (``make_classification``, 50,000 × 784, 10 classes,
50 informative, ``random_state=0``), the same with its features scaled over three
orders of magnitude (ill-conditioned), and 200,000 synthetic rows (4,000,000 on a GPU or
TPU, where meshkit also runs with the gradient in one row block). Interleaved rounds
(A B C ..., the order rotating) of:

- the JAXopt notebook's program with the smallest change that runs today:
  ``jaxopt.LBFGS(fun=multiclass_logreg, stepsize=0.0, linesearch="zoom")``, ``update``
  under ``jax.jit`` with the data on ``P('data')``, and the notebook's Python loop that
  blocks on every step and reads ``state.error``;
- ``jaxopt.LBFGS(...).run`` under ``jax.jit`` (jaxopt's own loop, one program);
- ``optax.lbfgs()`` stepped in a jitted ``while_loop`` (the optax documentation's loop);
- ``meshkit.lbfgs.LBFGS(...).solve`` with its defaults, and with jaxopt's ``history_size=10,
  c2=0.9``;
- one read of X (``jnp.sum(x, axis=0)``), the memory-bandwidth floor of an evaluation.

Reported per problem: the ratio of total times (compile excluded), iterations,
evaluations, ms per evaluation against one read of X; then compile times, the final
objective against scipy's float64 L-BFGS-B optimum, compile counts for repeated solves
on new data and for a sweep and a grid of strengths, time per iteration at 10k, 20k and
40k rows, and peak memory (process RSS: on the CPU backend ``Device.memory_stats()`` is
``None``).
"""

from __future__ import annotations

import time
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

from benchmarks._harness import interleave, peak_rss_mib, report, reset_peak_rss, save  # noqa: E402
from benchmarks._hlo import operations_per_call  # noqa: E402
from benchmarks._lbfgs_peers import jaxopt_run, optax_loop  # noqa: E402
from benchmarks.quoted import markdown_table  # noqa: E402
from meshkit import lbfgs  # noqa: E402

ON_CPU = jax.devices()[0].platform == "cpu"
ROWS, FEATURES, CLASSES = 50_000, 784, 10
TOL = 1e-3
ROUNDS = 5
MAX_STEPS = 2000
LARGE_ROWS = 200_000 if ON_CPU else 4_000_000
ILL_ROWS = 20_000
SCALING_ROWS = (10_000, 20_000, 40_000)
SCALING_STEPS = 25


def seed_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = datasets.make_classification(
        n_samples=rows, n_features=FEATURES, n_classes=CLASSES, n_informative=50, random_state=seed
    )
    return np.asarray(x, np.float32), np.asarray(y, np.int32)


class SeedLoop:
    """The notebook's ``fit`` loop, ported: jit instead of the removed pjit, P('data') data."""

    def __init__(self, data: tuple[jax.Array, jax.Array], *, max_steps: int = 500):
        self.data, self.max_steps = data, max_steps
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
        for _ in range(self.max_steps):
            params, state = self.update(params, state, self.data)
            jax.tree.map(lambda t: t.block_until_ready(), (params, state))  # as the notebook
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
    # On the 2-core CPU backend, BLAS threads fighting over busy cores are far slower.
    with threadpool_limits(1 if ON_CPU else None):
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


def ill_conditioned(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``large_data`` with its features scaled over two orders of magnitude (a fixed order)."""
    x, y = large_data(rows)
    scales = np.logspace(-1, 1, x.shape[1]).astype(np.float32)
    return x * np.random.default_rng(0).permutation(scales), y


def large_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian features, labels from a random linear model with Gumbel noise.

    Past a million rows on an accelerator the numbers are drawn there (seconds instead
    of minutes of host time) and copied back, as the other problems' arrays are.
    """
    if rows > 1_000_000 and not ON_CPU:
        return large_data_drawn_on_device(rows)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32) / np.sqrt(FEATURES)
    y = np.argmax(x @ w + rng.gumbel(size=(rows, CLASSES)), axis=1).astype(np.int32)
    return x, y


def large_data_drawn_on_device(rows: int) -> tuple[np.ndarray, np.ndarray]:
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows, FEATURES), jnp.float32)
    w = jax.random.normal(kw, (FEATURES, CLASSES), jnp.float32) / np.sqrt(FEATURES)
    y = jnp.argmax(x @ w + jax.random.gumbel(kg, (rows, CLASSES)), axis=1).astype(jnp.int32)
    host = np.asarray(x), np.asarray(y)
    del x, y
    return host


def compare_peers(
    problem: str, mesh, x: np.ndarray, y: np.ndarray, *, rounds: int, seed_loop: bool
) -> dict[str, Any]:
    """Every solver to ||g|| <= TOL on one problem, interleaved, beside one read of X."""
    rows = NamedSharding(mesh, P("data"))
    arrays = (jax.device_put(x, rows), jax.device_put(y, rows))
    data = lbfgs.classification_data(x, y, mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES)
    w0 = jnp.zeros((FEATURES, CLASSES), jnp.float32)
    outcomes: dict[str, tuple[float, float, int, int]] = {}

    def peer(name: str, program) -> Any:
        def run() -> None:
            value, norm, iterations, evaluations = jax.block_until_ready(program(w0, arrays))
            outcomes[name] = (float(value), float(norm), int(iterations), int(evaluations))

        return run

    def meshkit_solve(name: str, solver: lbfgs.LBFGS) -> Any:
        def run() -> None:
            s = jax.block_until_ready(solver.solve(start, data, throw=False))
            outcomes[name] = (
                float(s.value),
                float(s.grad_norm),
                int(s.iterations),
                int(s.num_evaluations),
            )

        return run

    read = jax.jit(lambda x: jnp.sum(x, axis=0))
    candidates: dict[str, Any] = {}
    if seed_loop:
        loop = SeedLoop(arrays, max_steps=MAX_STEPS)

        def run_loop() -> None:
            loop()
            state = loop.state
            outcomes["notebook jaxopt loop (ported)"] = (
                float(state.value),
                loop.errors[-1],
                int(state.iter_num),
                int(state.num_fun_eval),
            )

        candidates["notebook jaxopt loop (ported)"] = run_loop
    candidates |= {
        "jaxopt.LBFGS.run, jitted": peer(
            "jaxopt.LBFGS.run, jitted", jaxopt_run(tol=TOL, max_steps=MAX_STEPS)
        ),
        "optax.lbfgs, jitted loop": peer(
            "optax.lbfgs, jitted loop", optax_loop(tol=TOL, max_steps=MAX_STEPS)
        ),
        "meshkit.lbfgs solve": meshkit_solve(
            "meshkit.lbfgs solve",
            lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL, max_steps=MAX_STEPS),
        ),
        "meshkit, history_size=10": meshkit_solve(
            "meshkit, history_size=10",
            lbfgs.LBFGS(
                lbfgs.multiclass_logreg, mesh, tol=TOL, max_steps=MAX_STEPS, history_size=10
            ),
        ),
        "one read of X": lambda: jax.block_until_ready(read(arrays[0])),
    }
    if not ON_CPU:  # the gradient's sum in one long reduction, as on CPUs
        candidates["meshkit, one row block"] = meshkit_solve(
            "meshkit, one row block",
            lbfgs.LBFGS(
                lbfgs.multiclass_logreg, mesh, tol=TOL, max_steps=MAX_STEPS, gradient_blocks=1
            ),
        )
    timings = interleave(candidates, rounds=rounds, warmup=1)
    title = (
        f"{problem}: {len(x):,} x {FEATURES} x {CLASSES} to ||g|| <= {TOL}, "
        f"{jax.device_count()} devices, {rounds} rounds interleaved (compile excluded)"
    )
    result = report(title, timings, baseline="meshkit.lbfgs solve", unit="solve")
    read_s = timings["one read of X"].median
    result["one_read_of_x_ms"] = 1e3 * read_s
    result["bandwidth_gb_per_s"] = x.nbytes / read_s / 1e9
    mine = timings["meshkit.lbfgs solve"].total
    print(f"  one read of X: {1e3 * read_s:.2f} ms ({result['bandwidth_gb_per_s']:.1f} GB/s)")
    print(
        f"  {'solver':<32} {'iters':>6} {'evals':>6} {'ms/eval':>8} {'x read':>7} "
        f"{'value':>11} {'meshkit/this':>13}"
    )
    for name, (value, norm, iterations, evaluations) in outcomes.items():
        per_eval = 1e3 * timings[name].median / max(evaluations, 1)
        ratio = mine / timings[name].total
        result["candidates"][name].update(
            value=value,
            grad_norm=norm,
            iterations=iterations,
            evaluations=evaluations,
            ms_per_evaluation=per_eval,
            evaluation_over_one_read=per_eval / (1e3 * read_s),
            meshkit_total_over_this=ratio,
        )
        print(
            f"  {name:<32} {iterations:>6} {evaluations:>6} {per_eval:>8.2f} "
            f"{per_eval / (1e3 * read_s):>7.2f} {value:>11.7f} {ratio:>13.3f}"
        )
    return result


def operations_per_iteration(mesh, data, start) -> dict[str, int]:
    """Operations in one compiled ``step`` (optimized HLO): ``fixed`` outside the line
    search, ``per_trip_0`` per line-search evaluation."""
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL)
    state = solver.init(start, data)
    step: Any = solver._programs().step  # the jitted program behind LBFGS.step
    text = step.lower(state, data, jnp.float32(0.0)).compile().as_text()
    counts = operations_per_call(text)
    print(
        f"operations per iteration (history_size={solver.history_size}): {counts['fixed']} "
        f"outside the line search, {counts.get('per_trip_0')} per line-search evaluation"
    )
    return counts


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


def first_calls(mesh, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Compile time and count of each candidate's first call on the notebook's problem."""
    rows = NamedSharding(mesh, P("data"))
    arrays = (jax.device_put(x, rows), jax.device_put(y, rows))
    data = lbfgs.classification_data(x, y, mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES)
    w0 = jnp.zeros((FEATURES, CLASSES), jnp.float32)
    solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL, max_steps=MAX_STEPS + 1)
    candidates = {
        "notebook jaxopt loop (ported)": SeedLoop(arrays),
        "jaxopt.LBFGS.run, jitted": lambda: jaxopt_run(tol=TOL, max_steps=MAX_STEPS + 1)(
            w0, arrays
        ),
        "optax.lbfgs, jitted loop": lambda: optax_loop(tol=TOL, max_steps=MAX_STEPS + 1)(
            w0, arrays
        ),
        "meshkit.lbfgs solve": lambda: solver.solve(start, data, throw=False),
    }
    first = {}
    for name, run in candidates.items():
        with meshkit.count_compiles() as log:
            begin = time.perf_counter()
            jax.block_until_ready(run())
            seconds = time.perf_counter() - begin
        first[name] = {"first_call_s": seconds, "compile_s": log.seconds(), "compiles": log.count()}
        print(
            f"  first call {name}: {seconds:.2f} s, compile {log.seconds():.2f} s "
            f"in {log.count()} programs"
        )
    return first


def main() -> None:
    mesh = meshkit.make_mesh("data=-1")
    x, y = seed_data(ROWS)
    result: dict[str, Any] = {"tol": TOL, "max_steps": MAX_STEPS}
    print("compile (first calls, the notebook's problem):")
    result["first_calls"] = first_calls(mesh, x, y)
    result["problems"] = {
        "seed": compare_peers(
            "the JAXopt notebook's problem", mesh, x, y, rounds=ROUNDS, seed_loop=True
        ),
        "ill_conditioned": compare_peers(
            f"ill-conditioned ({ILL_ROWS:,} synthetic rows, features scaled over 1e-1 .. 1e1)",
            mesh,
            *ill_conditioned(ILL_ROWS),
            rounds=3,
            seed_loop=True,
        ),
        "large": compare_peers(
            f"{LARGE_ROWS:,} rows (synthetic)",
            mesh,
            *large_data(LARGE_ROWS),
            rounds=3,
            seed_loop=False,
        ),
    }
    data = lbfgs.classification_data(x, y, mesh)
    start = lbfgs.linear_params(FEATURES, CLASSES)
    ours = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, tol=TOL).solve(start, data, throw=False)
    reference, scipy_s = scipy_reference(x, y)
    result["scipy"] = {"value": reference, "seconds": scipy_s}
    result["relative_gap_to_scipy"] = (float(ours.value) - reference) / reference
    print(
        f"\nfinal objective: meshkit {float(ours.value):.7f}, scipy float64 {reference:.7f} "
        f"(relative gap {result['relative_gap_to_scipy']:.1e}; scipy took {scipy_s:.1f} s)"
    )
    result["operations_per_iteration"] = operations_per_iteration(mesh, data, start)
    result["compile_counts"] = compile_counts(mesh, data, start)
    counts = result["compile_counts"]
    print(
        f"compiles: {counts['solve_compiles']} for {counts['solves']} solves (new data, "
        f"3 strengths); {counts['grid_compiles']} for {counts['grid_solves']} grids of 4"
    )
    print(
        f"\nmeshkit time per iteration ({SCALING_STEPS} iterations, {jax.device_count()} devices):"
    )
    result["scaling"] = scaling(mesh)
    if ON_CPU:  # process RSS measures device memory only on the CPU backend
        result["peak_memory"] = peak_memory()
    save("lbfgs", result, tables)


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
        f"\npeak RSS (fresh process, one first solve incl. compile): notebook loop "
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


SOLVERS = {
    "notebook jaxopt loop (ported)": "the notebook's loop, ported",
    "jaxopt.LBFGS.run, jitted": "`jaxopt.LBFGS.run`, jitted",
    "optax.lbfgs, jitted loop": "`optax.lbfgs`, jitted loop",
    "meshkit.lbfgs solve": "`meshkit.lbfgs` `solve` (defaults)",
    "meshkit, history_size=10": "`meshkit.lbfgs`, `history_size=10`",
}


def _solver_table(problem: dict[str, Any]) -> str:
    """One read of X (the floor of an evaluation), then each solver's iterations,
    evaluations, cost per evaluation and meshkit's time over its time (bold where
    meshkit is faster than a peer)."""
    read = problem["one_read_of_x_ms"]
    label = "one read of X"
    if "bandwidth_gb_per_s" in problem:
        label += f" ({problem['bandwidth_gb_per_s'] * read:,.0f} MB at"
        label += f" {problem['bandwidth_gb_per_s']:.1f} GB/s)"
    rows = [[label, "", "", f"{read:.1f}", "1.00", ""]]
    for name, label in SOLVERS.items():
        row = problem["candidates"].get(name)
        if row is None:
            continue
        ratio = f"{row['meshkit_total_over_this']:.3f}"
        peer = not name.startswith("meshkit")
        rows.append(
            [
                label,
                str(row["iterations"]),
                f"{row['evaluations']}{' ¹' if 'jaxopt' in name else ''}",
                f"{row['ms_per_evaluation']:.1f}",
                f"{row['evaluation_over_one_read']:.2f}",
                f"**{ratio}**" if peer and row["meshkit_total_over_this"] < 1 else ratio,
            ]
        )
    header = ["solver", "iterations", "evaluations", "ms / evaluation", "× one read of X"]
    return markdown_table([*header, "meshkit / this"], rows)


def tables(run: dict[str, Any]) -> dict[str, str]:
    """A solver table per problem (``seed``, ``ill_conditioned``, ``large``); the
    time per iteration at three sizes (``scaling``); the final objective against
    scipy's (``exactness``); operations per iteration (``operations``); compiles
    (``compiles``); on a CPU the peak resident memory of a first solve (``peak_memory``)."""
    made = {name: _solver_table(problem) for name, problem in run["problems"].items()}
    scaling = [
        [
            f"{int(size):,}",
            f"{row['ms_per_iteration']:.1f}",
            f"{row['ms_per_evaluation']:.1f}",
            f"{row['evaluations'] / row['iterations']:.2f}",
        ]
        for size, row in run["scaling"].items()
    ]
    header = ["rows", "ms / iteration", "ms / evaluation", "evaluations / iteration"]
    made["scaling"] = markdown_table(header, scaling, "rrrr")
    meshkit = run["problems"]["seed"]["candidates"]["meshkit.lbfgs solve"]["value"]
    exactness = [
        ["`meshkit.lbfgs` (float32)", f"{meshkit:.7f}", f"{run['relative_gap_to_scipy']:.1e}"],
        ["scipy's L-BFGS-B (float64)", f"{run['scipy']['value']:.7f}", ""],
    ]
    made["exactness"] = markdown_table(["", "final objective", "relative gap"], exactness)
    ops = run["operations_per_iteration"]
    made["operations"] = markdown_table(
        ["one compiled step", "outside the line search", "per line-search evaluation"],
        [["`history_size=20`", str(ops["fixed"]), str(ops["per_trip_0"])]],
    )
    counts = run["compile_counts"]
    made["compiles"] = markdown_table(
        ["", "calls", "compiles"],
        [
            ["`solve`", str(counts["solves"]), str(counts["solve_compiles"])],
            [
                "`solve_many` (4 strengths each)",
                str(counts["grid_solves"]),
                str(counts["grid_compiles"]),
            ],
        ],
    )
    if "peak_memory" in run:
        peaks = [
            [
                label,
                f"{row['before_mib']:.0f}",
                f"{row['peak_mib']:.0f}",
                f"{row['growth_mib']:.0f}",
            ]
            for label, row in (
                ("the notebook's loop", run["peak_memory"]["seed"]),
                ("`meshkit.lbfgs`", run["peak_memory"]["meshkit"]),
            )
        ]
        header = ["a first solve", "before (MiB)", "peak (MiB)", "growth (MiB)"]
        made["peak_memory"] = markdown_table(header, peaks)
    return made


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--peak-memory":
        measure_one(sys.argv[2])
    else:
        main()
