"""A B A B timing: candidates run interleaved in one process, medians and ratios of totals."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import flax.linen as nn
import jax

import meshkit
from benchmarks import quoted

RESULTS = Path(__file__).parent / "results"


class Measured(float):
    """Seconds a candidate measured itself (e.g. its steady state, after a first step).

    A candidate that returns a ``Measured`` is timed by it instead of by the wall time
    of the whole call.
    """


@dataclasses.dataclass
class Timing:
    """Seconds per call of one candidate, over all rounds."""

    name: str
    seconds: list[float]
    compiles: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def total(self) -> float:
        return sum(self.seconds)


def interleave(
    candidates: Mapping[str, Callable[[], Any]], *, rounds: int, warmup: int = 2
) -> dict[str, Timing]:
    """Calls each candidate once per round, in turn (A B A B ...), after ``warmup`` rounds.

    The order rotates from round to round, so position effects average out.

    Each candidate must block until its work is done (``jax.block_until_ready``), or
    return the ``Measured`` seconds of the part it times itself.
    ``Timing.compiles`` counts every XLA compilation a candidate triggered, warm-up
    included (the first call's compile is expected; more mean recompiles).
    """
    timings = {name: Timing(name, []) for name in candidates}
    names = list(candidates)
    for round_index in range(warmup + rounds):
        # Rotate the order each round (A B C, B C A, C A B) so no candidate always
        # follows the same one.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run = candidates[name]
            with meshkit.count_compiles() as log:
                start = time.perf_counter()
                returned = run()
                elapsed = time.perf_counter() - start
            if isinstance(returned, Measured):
                elapsed = float(returned)
            timings[name].compiles += log.count()
            if round_index >= warmup:
                timings[name].seconds.append(elapsed)
    return timings


def environment() -> dict[str, Any]:
    """Versions and devices, recorded beside every result."""
    import flax
    import optax

    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }


def report(
    title: str, timings: Mapping[str, Timing], *, baseline: str, unit: str = "step"
) -> dict[str, Any]:
    """Prints a table (median, total, ratio of totals vs ``baseline``) and returns it as a dict."""
    base = timings[baseline]
    print(f"\n{title}")
    columns = f"{'median ms/' + unit:>16} {'total s':>9} {'total/base':>11} {'compiles':>9}"
    print(f"{'candidate':<34} {columns}")
    rows = {}
    for name, t in timings.items():
        ratio = t.total / base.total
        print(f"{name:<34} {t.median * 1e3:>16.3f} {t.total:>9.3f} {ratio:>11.3f} {t.compiles:>9}")
        rows[name] = {
            "median_s": t.median,
            "total_s": t.total,
            "rounds": len(t.seconds),
            "ratio_of_totals_vs_baseline": ratio,
            "compiles": t.compiles,
        }
    return {"title": title, "baseline": baseline, "candidates": rows}


def save(
    name: str,
    results: dict[str, Any],
    tables: quoted.Tables | None = None,
) -> Path:
    """Writes ``benchmarks/results/<name>.json`` with the environment beside the numbers,
    and ``<name>.md`` with the run's ``versions`` line and its ``tables`` (what the docs
    quote once the run is recorded: ``python -m benchmarks.quoted record <name>``). On an
    accelerator the run is ``<name>_gpu`` or ``<name>_tpu``, so it never replaces the
    CPU run the docs quote."""
    RESULTS.mkdir(exist_ok=True)
    run = {"environment": environment(), **results}
    backend = run["environment"]["platform"]
    if backend != "cpu":
        name = f"{name}_{'gpu' if backend in ('gpu', 'cuda', 'rocm') else backend}"
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(run, indent=2))
    print(f"\nwrote {path}")
    if tables is not None:
        quoted.write_tables(RESULTS, name, run, tables)
    return path


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


def stopped_by_a_signal(result: Any) -> Any:
    """``result`` of a ``fit`` or ``run_sweep``, or the benchmark's end when a signal
    stopped that run: ``fit`` takes a SIGTERM or a first Ctrl-C as a preemption (it
    saves and returns), which would otherwise only end the round and start the next."""
    if getattr(result, "preempted", False) or getattr(result, "interrupted", False):
        raise SystemExit("benchmark stopped: a run was asked to stop (SIGTERM or Ctrl-C)")
    return result


def fit_once(state: Any, step: Callable[..., Any], pipeline: Any, *, steps: int, n: Any = 1) -> Any:
    """One ``meshkit.train.fit`` run of ``steps`` steps in a fresh workdir: one checkpoint
    (the last step), no progress bar, ``n`` steps per dispatch."""
    import tempfile

    from meshkit import train

    with tempfile.TemporaryDirectory() as workdir:
        return stopped_by_a_signal(
            train.fit(
                state,
                step,
                pipeline,
                num_steps=steps,
                workdir=workdir,
                checkpoints=train.Checkpoints(every=steps),
                logging=train.Logging(progress=False),
                dispatch=train.Dispatch(steps_per_dispatch=n),
            )
        )


class TinyMLP(nn.Module):
    """64 inputs, 32 hidden units, 10 classes: a step of a few microseconds of math."""

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        x = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def digits_classifier(
    module: nn.Module, *, image_size: Literal[8, 28], mesh: Any
) -> tuple[Any, Callable[[], Any], Callable[..., Any]]:
    """The digits at ``image_size``, a fresh-state maker (SGD with momentum, seed 0) and
    the jitted train step of ``module`` on ``mesh``: what every candidate shares."""
    import jax.numpy as jnp
    import optax

    from meshkit import data, train

    source = data.digits("train", image_size=image_size)
    model = train.linen_model(module, jnp.zeros((1, image_size, image_size, 1)))
    tx = optax.sgd(0.05, momentum=0.9)

    def fresh_state() -> Any:
        return train.create_train_state(model, tx, mesh, seed=0)

    step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(fresh_state()),
        meshkit.batch_sharding(mesh),
    )
    return source, fresh_state, step
