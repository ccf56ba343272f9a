"""The planning recipe as a user runs it, and the planner against a published measured run.

    python -m benchmarks plan_recipe     # or: nox -s bench

1. ``python -m recipes.plan`` with no arguments in a fresh process, timed by the wall
   clock around it (imports and every compile included): its output is what
   docs/planning.md and docs/recipes/plan.md quote.
2. The 1.3B GPT at the setup of LLM Foundry's MPT-1B benchmark (64 H100s in 8 nodes,
   sequences of 2048, bf16, FSDP over the 8 GPUs of a node and data parallelism across
   nodes, no activation checkpointing), planned with ``python -m meshkit.plan`` at a
   batch of 256 sequences, against the step the benchmark measured for 256 x 2048
   tokens: 44,402 tokens per second per GPU, 0.185 s. Through XLA:CPU, and through
   XLA:GPU too where ``GPU_PLAN_PYTHON`` names a Python with JAX's CUDA plugin
   (``pip install "meshkit[gpu-plan]"``; the recipe keeps the XLA:CPU figures a plain
   install prints).
3. Where ``TPU_PLAN_PYTHON`` names a Python with libtpu (``pip install
   "meshkit[tpu]"``), ``python -m recipes.plan --targets v5e-256`` with it: the v5e
   plan through the TPU compiler, with the flash kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import save
from benchmarks.quoted import markdown_table

MPT_1B_TOKENS_PER_SECOND_PER_GPU = 44_402
"""LLM Foundry's H100 BF16 table, MPT-1B, sequence 2048, 64 GPUs (docs/planning.md)."""

MPT_1B_ARGV = [
    "--model", "gpt-1.3b", "--accelerator", "h100", "--devices", "64", "--slices", "8",
    "--batch-size", "256", "--length", "2048", "--tensor", "1", "--fsdp", "8",
    "--remat", "none", "--precision", "bf16", "--quiet",
]  # fmt: skip
"""The MPT-1B setup as a plan: data=8 (across nodes) x fsdp=8 (within one)."""


def run_recipe(python: str = sys.executable, *argv: str) -> dict[str, Any]:
    """``python -m recipes.plan argv`` in a fresh process: its output and wall seconds."""
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        done = subprocess.run(
            [python, "-m", "recipes.plan", *argv, "--workdir", workdir],
            capture_output=True,
            text=True,
            check=True,
        )
        seconds = time.perf_counter() - start
    print(done.stdout)
    return {"seconds": seconds, "stdout": done.stdout}


def plan_mpt_1b(python: str, compiler: str) -> dict[str, Any]:
    """The MPT-1B setup planned in a fresh process of ``python`` by ``compiler``."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "plan.json"
        argv = [*MPT_1B_ARGV, "--compiler", compiler, "--json", str(path)]
        done = subprocess.run(
            [python, "-m", "meshkit.plan", *argv], capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise SystemExit(f"planning MPT-1B failed:\n{done.stderr[-3000:]}")
        layout = json.loads(path.read_text())["layouts"][0]
    print(done.stdout)
    return layout


def main() -> None:
    planners = [(sys.executable, "cpu")]
    if os.environ.get("GPU_PLAN_PYTHON"):
        planners.append((os.environ["GPU_PLAN_PYTHON"], "gpu"))
    mpt = [plan_mpt_1b(python, compiler) for python, compiler in planners]
    measured = 256 * 2048 / 64 / MPT_1B_TOKENS_PER_SECOND_PER_GPU
    results = {"recipe": run_recipe(), "mpt_1b": mpt, "mpt_1b_measured_seconds": measured}
    if os.environ.get("TPU_PLAN_PYTHON"):
        tpu = run_recipe(os.environ["TPU_PLAN_PYTHON"], "--targets", "v5e-256", "--quiet")
        results["recipe_tpu"] = tpu
    save("plan_recipe", results, tables)


def _recipe_table(recipe: dict[str, Any], command: str) -> str:
    """The recipe's output (without the line naming its temporary folder) and wall time."""
    output = recipe["stdout"].rstrip().split("\n")
    text = "\n".join(line for line in output if "plot:" not in line).strip()
    return (
        f"`{command}`, {recipe['seconds']:.0f} s from the command to its last line:\n\n"
        f"```text\n{text}\n```"
    )


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``recipe``: the recipe's output and its wall time; ``recipe_tpu`` the same for the
    v5e through the TPU compiler, where it ran; ``mpt_1b``: the plan of MPT-1B's setup
    against its measured step."""
    recipe_table = _recipe_table(run["recipe"], "python -m recipes.plan")
    measured = run["mpt_1b_measured_seconds"]
    rows = []
    for layout in run["mpt_1b"]:
        low, high = layout["step_seconds_range"]
        planned = layout["estimated_step_seconds"]
        terms = layout["step_time_terms_seconds"]
        rows.append(
            [
                layout["layout"],
                layout["compiler"],
                f"{layout['flops_per_device'] / 1e12:.1f}",
                f"{layout['collective_bytes_per_device'] / 2**30:.2f}",
                f"{terms['compute']:.3f}",
                f"{terms['ici'] + terms['dcn']:.3f}",
                f"**{planned:.3f} s** ({low:.3f}-{high:.3f})",
                f"{measured:.3f} s",
                f"**{planned / measured:.2f}**",
                f"{layout['estimated_mfu']:.1%}",
            ]
        )
    header = ["layout", "figures from", "TFLOP per GPU", "collectives GiB per GPU"]
    header += ["compute s", "collectives s", "planned step (range)", "measured step"]
    header += ["planned / measured", "planned MFU (measured 40.85%)"]
    found = {"recipe": recipe_table, "mpt_1b": markdown_table(header, rows, "ll" + "r" * 8)}
    if "recipe_tpu" in run:
        command = "python -m recipes.plan --targets v5e-256  # with libtpu installed"
        found["recipe_tpu"] = _recipe_table(run["recipe_tpu"], command)
    return found


if __name__ == "__main__":
    main()
