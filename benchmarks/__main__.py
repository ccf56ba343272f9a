"""Runs the benchmarks: ``python -m benchmarks [name ...]`` (all by default).

Each benchmark runs in its own process, so each can choose its device count before
JAX starts.
"""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = [
    "fit_overhead",
    "host_placement",
    "data_parallel_step",
    "precision",
    "data_loader",
    "input_pipeline",
    "full_eval",
    "ensemble",
    "sweep",
    "lbfgs",
    "plan",
    "plan_recipe",
    "activations",
    "hf_import",
]


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}", file=sys.stderr)
        return 2
    failed = 0
    for name in names or BENCHMARKS:
        print(f"=== {name}", flush=True)
        failed |= subprocess.call([sys.executable, "-m", f"benchmarks.{name}"])
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
