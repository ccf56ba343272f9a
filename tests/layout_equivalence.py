"""Every recipe gives the same answer on 1 process × 8 devices and on 2 processes × 4 devices.

    python tests/layout_equivalence.py                  # every recipe (nox -s layouts)
    python tests/layout_equivalence.py lbfgs ensemble   # some of them

Each recipe runs for a few steps under ``python -m meshkit.launch``, once as one
process with 8 fake CPU devices and once as two processes with 4 each, with the same
arguments. The numbers it reports (training losses, test losses and accuracies,
solver values, example counts) must agree: counts exactly, accuracies to within one
test example, everything else to a relative 1e-4. A table of both runs' values and
wall times is printed; the exit code is 1 if any value differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

LAYOUTS = {"1x8": (1, 8), "2x4": (2, 4)}
Values = dict[str, float]


def _summary(*keys: str) -> Callable[[Path, str], Values]:
    """Reads ``keys`` (``a/b`` for nested, lists flattened) from ``<workdir>/summary.json``."""

    def read(workdir: Path, _stdout: str) -> Values:
        summary = json.loads((workdir / "summary.json").read_text())
        values: Values = {}
        for key in keys:
            value = summary
            for part in key.split("/"):
                value = value[part]
            if isinstance(value, list):
                values.update({f"{key}[{i}]": float(v) for i, v in enumerate(value)})
            else:
                values[key] = float(value)
        return values

    return read


def _printed_loss(_workdir: Path, stdout: str) -> Values:
    match = re.search(r"loss on 8 devices: ([\d.]+)\s+\(1 device: ([\d.]+)\)", stdout)
    if not match:
        raise ValueError(f"No 'loss on 8 devices' line in the output:\n{stdout[-2000:]}")
    return {"loss": float(match.group(1)), "one_device_loss": float(match.group(2))}


@dataclasses.dataclass(frozen=True)
class Case:
    """A recipe run for a few steps, and how to read its results."""

    args: tuple[str, ...]  # "{workdir}" is replaced by the run's work directory
    read: Callable[[Path, str], Values]


FULL_EVAL_METHODS = [
    "simple batching, keep remainder",
    "drop_remainder",
    "meshkit.evaluate.pad_shard_unpad",
    "meshkit.evaluate.full_eval",
]
CASES = {
    "sharding_demo": Case((), _printed_loss),
    "data_parallel": Case(
        (
            *("--model", "norm_cnn", "--steps", "8", "--batch-size", "64"),
            *("--eval-every", "8", "--checkpoint-every", "8", "--no-progress"),
            *("--workdir", "{workdir}"),
        ),
        _summary("final_train_loss", "test_loss", "test_accuracy", "test_examples"),
    ),
    "ensemble": Case(
        ("--steps", "4", "--batch-size", "32", "--no-progress", "--workdir", "{workdir}"),
        _summary(
            "final_train_loss",
            "ensemble_test_loss",
            "ensemble_test_accuracy",
            "member_test_loss",
            "member_test_accuracy",
            "test_examples",
        ),
    ),
    "sweep": Case(
        ("--pbt", "--steps", "9", "--no-progress", "--workdir", "{workdir}"),
        _summary("trials", "best", "best_test_accuracy", "best_test_loss"),
    ),
    "full_eval": Case(
        ("--train-steps", "10", "--workdir", "{workdir}"),
        _summary(*(f"{m}/{k}" for m in FULL_EVAL_METHODS for k in ("examples", "accuracy"))),
    ),
    "image_classification": Case(
        (
            *("--steps", "6", "--batch-size", "64", "--warmup-steps", "2", "--eval-every", "6"),
            *("--checkpoint-every", "6", "--no-progress", "--workdir", "{workdir}"),
        ),
        _summary("final_train_loss", "test_loss", "test_accuracy", "test_examples"),
    ),
    "transformer_lm": Case(
        (
            *("--steps", "8", "--warmup-steps", "2", "--eval-every", "8"),
            *("--checkpoint-every", "8", "--no-progress", "--workdir", "{workdir}"),
        ),
        _summary("final_train_loss", "test_loss"),
    ),
    "lbfgs": Case(
        (
            *("--num-samples", "4000", "--num-features", "64", "--maxiter", "20"),
            *("--no-single", "--workdir", "{workdir}"),
        ),
        _summary(*(f"runs/sharded (8 devices)/{k}" for k in ("value", "grad_norm", "evaluations"))),
    ),
}


def run(recipe: str, layout: str, workdir: Path, timeout: float = 600) -> tuple[Values, float]:
    """Runs ``recipe`` in ``layout`` ("1x8" or "2x4"); returns its values and wall seconds."""
    processes, devices = LAYOUTS[layout]
    case = CASES[recipe]
    args = [arg.replace("{workdir}", str(workdir)) for arg in case.args]
    command = [sys.executable, "-m", "meshkit.launch", "-n", str(processes)]
    command += ["-d", str(devices), "--timeout", str(timeout), "--"]
    command += [sys.executable, "-m", f"recipes.{recipe}", *args]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if result.returncode:
        raise RuntimeError(
            f"recipes.{recipe} on {layout} exited with code {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    rank0 = "\n".join(line[4:] for line in result.stdout.splitlines() if line.startswith("[0] "))
    return case.read(workdir, rank0), seconds


def mismatches(a: Values, b: Values) -> list[str]:
    """Where two runs' values disagree (empty when they agree), one line each."""
    if a.keys() != b.keys():
        return [f"different keys: {sorted(a.keys() ^ b.keys())}"]
    found = []
    for key in a:
        if "examples" in key or "evaluations" in key:
            same = a[key] == b[key]
        elif "accuracy" in key:
            same = abs(a[key] - b[key]) <= 1 / 360 + 1e-9  # one test digit
        else:
            same = math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6)
        if not same:
            found.append(f"{key}: {a[key]!r} vs {b[key]!r}")
    return found


def compare(recipe: str, root: Path) -> tuple[dict[str, Values], dict[str, float], list[str]]:
    """Runs ``recipe`` in both layouts under ``root``; returns values, seconds, mismatches."""
    values, seconds = {}, {}
    for layout in LAYOUTS:
        values[layout], seconds[layout] = run(recipe, layout, root / recipe / layout)
    return values, seconds, mismatches(values["1x8"], values["2x4"])


def main(names: Sequence[str]) -> int:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"unknown recipe(s) {unknown}; choose from {sorted(CASES)}", file=sys.stderr)
        return 2
    failed = []
    with tempfile.TemporaryDirectory(prefix="meshkit-layouts-") as root:
        for recipe in names or CASES:
            values, seconds, wrong = compare(recipe, Path(root))
            print(f"\n{recipe}: 1x8 {seconds['1x8']:.1f} s, 2x4 {seconds['2x4']:.1f} s")
            for key, value in values["1x8"].items():
                other = values["2x4"][key]
                print(f"  {key:<48} {value:>14.8g} {other:>14.8g}")
            print(f"  {'agree' if not wrong else 'DIFFER: ' + '; '.join(wrong)}", flush=True)
            if wrong:
                failed.append(recipe)
    print(f"\n{len(names or CASES) - len(failed)} recipe(s) agree; differ: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
