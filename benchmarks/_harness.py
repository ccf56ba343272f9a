"""A B A B timing: candidates run interleaved in one process, medians and ratios of totals."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

import meshkit

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


def save(name: str, results: dict[str, Any]) -> Path:
    """Writes ``benchmarks/results/<name>.json`` with the environment beside the numbers."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **results}, indent=2))
    print(f"\nwrote {path}")
    return path


def stopped_by_a_signal(result: Any) -> Any:
    """``result`` of a ``fit`` or ``run_sweep``, or the benchmark's end when a signal
    stopped that run: ``fit`` takes a SIGTERM or a first Ctrl-C as a preemption (it
    saves and returns), which would otherwise only end the round and start the next."""
    if getattr(result, "preempted", False) or getattr(result, "interrupted", False):
        raise SystemExit("benchmark stopped: a run was asked to stop (SIGTERM or Ctrl-C)")
    return result


def fit_once(
    state: Any,
    step: Callable[..., Any],
    pipeline: Any,
    *,
    steps: int,
    n: Any = 1,
    measured_before: bool = False,
) -> Any:
    """One ``meshkit.train.fit`` run of ``steps`` steps in a fresh workdir: one checkpoint
    (the last step), no progress bar, ``n`` steps per dispatch. ``'auto'`` measures the
    step afresh, as in a new process, unless ``measured_before``: then it chooses from
    what an earlier run in this process measured, as a second ``fit`` of a notebook or
    a sweep's next stage does."""
    import tempfile

    from meshkit import train
    from meshkit.train import _chunks

    if not measured_before:
        _chunks._MEASURED.clear()

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
