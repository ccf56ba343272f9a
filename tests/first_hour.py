"""A new user's first hour, replayed: a fresh clone, the README's commands, every recipe.

    python tests/first_hour.py                 # nox -s first_hour
    python tests/first_hour.py --with-tests    # also the README's test command (minutes)

Clones the committed HEAD of this repository into a temporary folder and creates a
fresh virtual environment there (its ``python3`` first on ``PATH``, nothing else
installed). Then, from the clone, it runs the README's first command exactly as
written (install with the ``recipes`` extra, then ``python3 -m recipes.data_parallel``)
and every other recipe with no arguments, and checks that each printed its expected
result. The wall time of each command is printed as a markdown table and written to
``benchmarks/results/first_hour.json`` (and ``.md``, its table); recorded (``python -m
benchmarks.quoted record first_hour``), it is the table in docs/recipes/index.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The ``python3 ...`` lines of the README's first bash block (its "two commands")."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    if block is None:
        raise ValueError("README.md has no ```bash block")
    return [line for line in block[1].splitlines() if line.startswith("python3 ")]


def _summary(clone: Path, recipe: str) -> dict:
    return json.loads((clone / "workdir" / recipe / "summary.json").read_text())


def check_data_parallel(clone: Path, _out: str) -> str:
    summary = _summary(clone, "data_parallel")
    assert summary["test_examples"] == 360 and summary["test_accuracy"] > 0.95, summary
    return f"test accuracy {summary['test_accuracy']:.4f} on 360 digits"


def check_ensemble(clone: Path, _out: str) -> str:
    summary = _summary(clone, "ensemble")
    ensemble, best = summary["ensemble_test_accuracy"], summary["best_member_test_accuracy"]
    assert summary["test_examples"] == 360 and ensemble >= best, summary
    return f"ensemble {ensemble:.4f} >= best member {best:.4f}"


def check_sweep(clone: Path, _out: str) -> str:
    summary = _summary(clone, "sweep")
    best, compiles = summary["best_test_accuracy"], summary["train_step_compiles"]
    assert summary["points"] == 16 and compiles == 1 and best >= 0.97, summary
    return f"16 settings, 1 compile, best test accuracy {best:.4f}"


def check_full_eval(clone: Path, _out: str) -> str:
    summary = _summary(clone, "full_eval")
    exact = summary["meshkit.evaluate.full_eval"]
    assert exact["examples"] == 360 and exact["compiles"] == 1, summary
    assert summary["drop_remainder"]["examples"] < 360, summary
    return f"full_eval: 360 examples, 1 compile, accuracy {exact['accuracy']:.4f}"


def check_lbfgs(clone: Path, _out: str) -> str:
    summary = _summary(clone, "lbfgs")
    assert summary["max_relative_value_difference"] < 1e-5, summary
    assert all((clone / name).exists() for name in summary["plots"]), summary["plots"]
    value = next(iter(summary["runs"].values()))["value"]
    return f"value {value:.6f} sharded = single device, 2 plots"


def check_image_classification(clone: Path, _out: str) -> str:
    summary = _summary(clone, "image_classification")
    accuracy, wait = summary["test_accuracy"], summary["input_wait_fraction"]
    assert summary["test_examples"] == 360 and accuracy > 0.95 and wait < 0.05, summary
    return f"test accuracy {accuracy:.4f} on 360 digits, input wait {wait:.1%}"


def check_transformer_lm(clone: Path, _out: str) -> str:
    summary = _summary(clone, "transformer_lm")
    bpc, target = summary["test_bits_per_char"], summary["target_bits_per_char"]
    assert bpc < target and summary["mesh"] == {"data": 4, "model": 2}, summary
    return f"{bpc:.3f} bits per character < {target}"


def check_finetune_lm(clone: Path, _out: str) -> str:
    summary = _summary(clone, "finetune_lm")
    before, after, target = (
        summary["test_loss_before"],
        summary["test_loss"],
        summary["target_loss"],
    )
    assert after < target < before and (clone / summary["finetuned"]).is_dir(), summary
    return f"held-out loss {before:.2f} -> {after:.2f} nats per token < {target}"


def check_sharding_demo(_clone: Path, out: str) -> str:
    match = re.search(r"loss on 8 devices: ([\d.]+)\s+\(1 device: ([\d.]+)\)", out)
    assert match and match[1] == match[2], out[-2000:]
    return f"loss {match[1]} on 8 devices = 1 device"


CHECKS: dict[str, Callable[[Path, str], str]] = {
    "python3 -m recipes.data_parallel": check_data_parallel,
    "python3 -m recipes.ensemble": check_ensemble,
    "python3 -m recipes.sweep": check_sweep,
    "python3 -m recipes.full_eval": check_full_eval,
    "python3 -m recipes.lbfgs": check_lbfgs,
    "python3 -m recipes.sharding_demo": check_sharding_demo,
    "python3 -m recipes.image_classification": check_image_classification,
    "python3 -m recipes.transformer_lm": check_transformer_lm,
    "python3 -m recipes.finetune_lm": check_finetune_lm,
}


def timed(command: str, clone: Path, env: dict[str, str]) -> tuple[float, str]:
    """Runs ``command`` with bash in ``clone``; returns (seconds, output). Raises on failure."""
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, check=False
    )
    seconds = time.monotonic() - start
    if result.returncode:
        raise RuntimeError(
            f"`{command}` failed with code {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return seconds, result.stdout


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--with-tests", action="store_true", help="also the test command")
    parser.add_argument("--keep", type=Path, help="clone here (kept) instead of a temp folder")
    parser.add_argument("--outputs", type=Path, help="save each command's output in this folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshkit-first-hour-") as tmp:
        clone = args.keep or Path(tmp) / "meshkit"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
        first, *rest = readme_commands()
        install, _, run_recipe = first.partition(" && ")
        commands = [install, run_recipe, *(c for c in CHECKS if c != run_recipe)]
        if args.with_tests:
            commands += rest
        rows = []
        for command in commands:
            print(f"$ {command}", flush=True)
            seconds, out = timed(command, clone, env)
            if args.outputs:
                args.outputs.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"\W+", "_", command.removeprefix("python3 -m "))[:60]
                (args.outputs / f"{len(rows)}_{name}.txt").write_text(out)
            check = CHECKS.get(command)
            result = check(clone, out) if check else "ok"
            print(f"  {seconds:.0f} s: {result}", flush=True)
            rows.append((command, seconds, result))
    print("\n| command | wall time | result |\n| --- | ---: | --- |")
    for command, seconds, result in rows:
        print(f"| `{command}` | {seconds:.0f} s | {result} |")
    write_results(rows)
    return 0


def write_results(rows: list[tuple[str, float, str]]) -> None:
    """``benchmarks/results/first_hour.json``: what docs/recipes/index.md and the README
    quote once recorded (``python -m benchmarks.quoted record first_hour``)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "environment": {
            "cores": len(os.sched_getaffinity(0)),
            "memory_gib": memory,
            "python": ".".join(map(str, sys.version_info[:3])),
        },
        "rows": [{"command": c, "seconds": s, "result": r} for c, s, r in rows],
    }
    path = ROOT / "benchmarks" / "results" / "first_hour.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    sys.path.insert(0, str(ROOT))
    from benchmarks import quoted

    quoted.write_tables(path.parent, "first_hour", results, tables)


def tables(run: dict) -> dict[str, str]:
    """``versions``: the machine and the date; ``table``: each command's wall time and
    checked result."""
    from benchmarks.quoted import markdown_table

    env = run["environment"]
    machine = f"{env['cores']} cores, {env['memory_gib']:.0f} GiB, Python {env['python']}"
    rows = [[f"`{r['command']}`", f"{r['seconds']:.0f} s", r["result"]] for r in run["rows"]]
    return {
        "versions": f"{machine}; recorded {run['date']}",
        "table": markdown_table(["command", "wall time", "result"], rows, "lrl"),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
