"""A 16-point hyperparameter sweep as one program against 16 sequential ``fit`` runs.

    python -m benchmarks sweep            # or: python -m benchmarks.sweep [--steps N]

On 8 fake CPU devices, both candidates train the MNIST CNN of the Flax examples on
the embedded 8×8 digits with AdamW over the same 4 × 4 log grid of learning rate ×
weight decay (the grid of ``recipes/sweep.py``), each setting for the same number of
steps (150, as the recipe) at global batch 64 from the same initial parameters, and
both end with a full evaluation of every setting on the test split:

- sweep: ``meshkit.sweep.run_sweep``, exactly as ``recipes/sweep.py`` runs it: the 16
  settings are the members of one ensemble state on ``ensemble=8,data=1`` (two per
  device), ``optax.inject_hyperparams(optax.adamw)``, one train step compiled once;
- sequential: what a user without ``meshkit.sweep`` writes: for each setting, an
  ``optax.adamw(learning_rate, weight_decay=...)``, ``create_train_state`` on
  ``data=-1`` (the batch split over the 8 devices), ``make_train_step`` and a ``fit``
  run with ``Evaluation`` after the last step; one model object, but each run's new
  optimizer is part of its state, so each run compiles its own state init, train step
  and eval step (the train step's compiles are reported apart, every one is counted).

Each call is a whole sweep, compiles included, in a fresh workdir: every candidate
call starts with ``jax.clear_caches()``, so every repetition compiles what a fresh
process would (without it, a second sweep would reuse the first one's programs).
Both candidates keep ``fit``'s default checkpoints. Calls are interleaved with
the harness's rotating order (sweep, sequential, then sequential, sweep, ...) after one
short untimed warm-up of both (2 steps) that pays the process's one-time costs.

Reported: medians and totals, the ratio of totals (sweep / sequential), member-steps
per second (settings × steps / wall seconds), every compilation and the train step's
compilations (the sweep's ``train_step_compiles``, and the sum of the ``fit`` runs'),
the seconds spent compiling, and the best test accuracy each candidate found.

A third candidate runs the same sweep with the training data resident on the devices
and ``Dispatch(steps_per_dispatch='auto')`` (``resident_auto_over_sweep``: its rate
over the sweep's, from totals; ``resident_auto_input``: what it chose).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import meshkit
from recipes._args import positive_int

meshkit.distributed.initialize(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks._harness import interleave, report, save, stopped_by_a_signal  # noqa: E402
from benchmarks.quoted import markdown_table  # noqa: E402
from meshkit import data, ensemble, sweep, train  # noqa: E402
from meshkit.models import MnistCNN  # noqa: E402

# As recipes/sweep.py. The whole benchmark takes about 9.5 minutes on a 2-core machine,
# and about as long at 100 steps: the sequential runs' compiles dominate it.
STEPS = 150
ROUNDS = 2
BATCH_SIZE = 64
EVAL_BATCH_SIZE = 128
GOAL = 0.5  # the sweep at most half the sequential wall time

SWEEP = "sweep: run_sweep, one program"
SWEEP_RESIDENT = "sweep: resident data, auto steps per dispatch"
SEQUENTIAL = "sequential: 16 fit runs"


class Bench:
    """The shared inputs of both candidates and what each call of them found."""

    def __init__(self) -> None:
        self.model = train.linen_model(MnistCNN(), jnp.zeros((1, 8, 8, 1)))
        self.train_source = data.digits("train")
        self.test_source = data.digits("test")
        self.space = sweep.Space(
            learning_rate=sweep.log_grid(1e-3, 1e-1, 4),
            weight_decay=sweep.log_grid(1e-5, 1e-2, 4),
        )
        self.points = self.space.grid()
        self.calls: dict[str, list[dict[str, Any]]] = {
            SWEEP: [],
            SWEEP_RESIDENT: [],
            SEQUENTIAL: [],
        }

    def run_sweep(self, steps: int, *, resident: bool = False) -> dict[str, Any]:
        """The whole sweep, as ``recipes/sweep.py`` runs it; ``resident``: the training
        data on the devices and ``steps_per_dispatch='auto'``."""
        layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=-1,data=1"), len(self.points))
        with tempfile.TemporaryDirectory() as workdir:
            experiment = sweep.Sweep(
                self.model,
                optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4),
                ensemble.classification_loss,
                layout,
                self.points,
                space=self.space,
            )
            result = sweep.run_sweep(
                experiment,
                pipeline=sweep.sweep_pipeline(
                    self.train_source,
                    self.points,
                    layout,
                    global_batch_size=BATCH_SIZE,
                    input_settings=data.InputSettings(resident=resident),
                ),
                evaluation=train.Evaluation(
                    data.EvalPipeline(
                        self.test_source,
                        global_batch_size=EVAL_BATCH_SIZE,
                        sharding=layout.batch_sharding,
                    )
                ),
                num_steps=steps,
                workdir=workdir,
                logging=train.Logging(progress=False),
                dispatch=train.Dispatch(steps_per_dispatch="auto" if resident else 1),
            )
            stopped_by_a_signal(result)
            jax.block_until_ready(result.state)
        accuracy = {t.id: t.metrics["accuracy"] for t in result.trials}
        return {
            "input": result.input_path,
            "train_step_compiles": result.train_step_compiles,
            "accuracy": [accuracy[k] for k in range(len(self.points))],
        }

    def run_sequential(self, steps: int, points: int | None = None) -> dict[str, Any]:
        """One ordinary data-parallel ``fit`` run per setting, one after another."""
        mesh = meshkit.make_mesh("data=-1")
        sharding = meshkit.batch_sharding(mesh)
        eval_pipeline = data.EvalPipeline(
            self.test_source, global_batch_size=EVAL_BATCH_SIZE, sharding=sharding
        )
        compiles, accuracy = [], []
        for point in self.points[:points]:
            tx = optax.adamw(point["learning_rate"], weight_decay=point["weight_decay"])
            state = train.create_train_state(self.model, tx, mesh, seed=0)
            step = train.make_train_step(
                train.classification_loss, train.state_shardings_of(state), sharding
            )
            pipeline = data.TrainPipeline(
                self.train_source, global_batch_size=BATCH_SIZE, sharding=sharding, seed=0
            )
            with tempfile.TemporaryDirectory() as workdir:
                result = train.fit(
                    state,
                    step,
                    pipeline,
                    num_steps=steps,
                    workdir=workdir,
                    evaluation=train.Evaluation(eval_pipeline),
                    logging=train.Logging(progress=False),
                )
                stopped_by_a_signal(result)
                jax.block_until_ready(result.state)
            compiles.append(result.train_step_compiles)
            accuracy.append(result.eval_metrics["accuracy"])
        return {"train_step_compiles": sum(compiles), "per_run": compiles, "accuracy": accuracy}

    def candidate(self, name: str, run: Callable[[], dict[str, Any]]) -> Callable[[], None]:
        """``run`` from cold caches, recording its compile seconds and what it found."""

        def call() -> None:
            jax.clear_caches()
            with meshkit.count_compiles() as log:
                found = run()
            found["compile_seconds"] = log.seconds()
            self.calls[name].append(found)

        return call


def summary(bench: Bench, name: str, steps: int, seconds: list[float]) -> dict[str, Any]:
    calls = bench.calls[name]
    accuracy = calls[-1]["accuracy"]
    best = max(range(len(accuracy)), key=lambda k: accuracy[k])
    compile_free = [wall - c["compile_seconds"] for wall, c in zip(seconds, calls, strict=True)]
    return {
        "seconds_per_call": seconds,
        "member_steps_per_second": len(bench.points) * steps / statistics.median(seconds),
        "train_step_compiles_per_call": [c["train_step_compiles"] for c in calls],
        "compile_seconds_per_call": [c["compile_seconds"] for c in calls],
        "median_compile_seconds": statistics.median(c["compile_seconds"] for c in calls),
        "median_seconds_excluding_compiles": statistics.median(compile_free),
        "test_accuracy": accuracy,
        "best_test_accuracy": accuracy[best],
        "best_point": bench.points[best],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=STEPS)
    parser.add_argument("--rounds", type=positive_int, default=ROUNDS)
    args = parser.parse_args(argv)
    bench = Bench()
    # One-time costs of the process (first programs, checkpoint and data machinery),
    # untimed: a 2-step sweep and one 2-step fit run.
    bench.run_sweep(2)
    bench.run_sequential(2, points=1)

    candidates = {
        SWEEP: bench.candidate(SWEEP, lambda: bench.run_sweep(args.steps)),
        SWEEP_RESIDENT: bench.candidate(
            SWEEP_RESIDENT, lambda: bench.run_sweep(args.steps, resident=True)
        ),
        SEQUENTIAL: bench.candidate(SEQUENTIAL, lambda: bench.run_sequential(args.steps)),
    }
    timings = interleave(candidates, rounds=args.rounds, warmup=0)
    title = (
        f"{len(bench.points)} AdamW settings of the MNIST CNN, 8x8 digits, batch {BATCH_SIZE}, "
        f"{args.steps} steps each, {jax.device_count()} devices, compiles included"
    )
    result = report(title, timings, baseline=SEQUENTIAL, unit="sweep")
    for name, timing in timings.items():
        result["candidates"][name].update(summary(bench, name, args.steps, timing.seconds))
    rows = result["candidates"]
    ratio = timings[SWEEP].total / timings[SEQUENTIAL].total
    result.update(
        steps=args.steps,
        points=len(bench.points),
        global_batch_size=BATCH_SIZE,
        sweep_over_sequential=ratio,
        resident_auto_over_sweep=timings[SWEEP].total / timings[SWEEP_RESIDENT].total,
        resident_auto_input=sorted({c["input"] for c in bench.calls[SWEEP_RESIDENT]}),
        goal=GOAL,
        goal_met=ratio <= GOAL,
        max_accuracy_difference=max(
            abs(a - b)
            for a, b in zip(
                rows[SWEEP]["test_accuracy"], rows[SEQUENTIAL]["test_accuracy"], strict=True
            )
        ),
    )
    print(
        f"{'candidate':<46} {'member-steps/s':>15} {'train step compiles':>20} "
        f"{'compile s':>10} {'s without compiles':>19}"
    )
    for name, row in rows.items():
        compiles = ",".join(str(c) for c in row["train_step_compiles_per_call"])
        print(
            f"{name:<46} {row['member_steps_per_second']:>15.1f} {compiles:>20} "
            f"{row['median_compile_seconds']:>10.1f} "
            f"{row['median_seconds_excluding_compiles']:>19.1f}"
        )
    for name, row in rows.items():
        print(f"{name}: best test accuracy {row['best_test_accuracy']:.4f} at {row['best_point']}")
    print(
        f"sweep / sequential (ratio of totals) {ratio:.3f} "
        f"(goal <= {GOAL}: {'met' if ratio <= GOAL else 'not met'}); "
        f"largest difference of a setting's test accuracy {result['max_accuracy_difference']:.4f}"
    )
    print(
        f"resident + auto / sweep (rates, from totals) {result['resident_auto_over_sweep']:.2f}x; "
        f"it ran {result['resident_auto_input']}"
    )
    save("sweep", result, tables)


LABELS = {
    SWEEP: "sweep (`run_sweep`, one program)",
    SWEEP_RESIDENT: "sweep, resident data and `'auto'` steps per dispatch",
    SEQUENTIAL: "sequential (16 `fit` runs)",
}
CELLS: dict[str, Callable[[dict[str, Any]], str]] = {
    "median": lambda c: f"{c['median_s']:.1f}",
    "total": lambda c: f"{c['total_s']:.1f}",
    "ratio": lambda c: f"{c['ratio_of_totals_vs_baseline']:.3f}",
    "rate": lambda c: f"{c['member_steps_per_second']:.1f}",
    "compiles": lambda c: str(c["compiles"]),
    "step compiles": lambda c: str(max(c["train_step_compiles_per_call"])),
    "compile s": lambda c: f"{c['median_compile_seconds']:.1f}",
    "without compiles": lambda c: f"{c['median_seconds_excluding_compiles']:.1f}",
    "accuracy": lambda c: f"{c['best_test_accuracy']:.4f}",
}


def _rows(run: dict[str, Any], cells: list[str]) -> list[list[str]]:
    """One row per candidate with the ``cells`` named, the sweep's ratio in bold."""
    rows = []
    for name, label in LABELS.items():
        row = [label] + [CELLS[cell](run["candidates"][name]) for cell in cells]
        if name == SWEEP and "ratio" in cells:
            row[1 + cells.index("ratio")] = f"**{row[1 + cells.index('ratio')]}**"
        rows.append(row)
    return rows


def _point(point: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in point.items())


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: every column; ``summary``: four of them; ``best``: the setting each way
    found best, and the largest difference of one setting's accuracy between the two."""
    calls = run["candidates"][SEQUENTIAL]["rounds"]
    header = ["candidate", "median s / 16 settings", f"total s ({calls} calls)"]
    header += ["total / sequential", "member-steps/s", f"compiles ({calls} calls)"]
    header += ["train step compiles per call", "median compile s", "median s without compiles"]
    header += ["best test accuracy"]
    summary = ["", "median s", "total / sequential", "member-steps/s", "train-step compiles"]
    best = [
        [LABELS[name], _point(c["best_point"]), f"{c['best_test_accuracy']:.4f}"]
        for name, c in run["candidates"].items()
        if name != SWEEP_RESIDENT
    ]
    difference, examples = run["max_accuracy_difference"], 360
    images = f"{difference:.4f} ({round(difference * examples)} of {examples} images)"
    best.append(["largest difference of one setting's test accuracy", "", images])
    return {
        "table": markdown_table(header, _rows(run, list(CELLS))),
        "summary": markdown_table(
            summary, _rows(run, ["median", "ratio", "rate", "step compiles"])
        ),
        "best": markdown_table(["", "best setting", "test accuracy"], best, "llr"),
    }


if __name__ == "__main__":
    main()
