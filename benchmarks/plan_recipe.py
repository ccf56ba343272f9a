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
   install prints). The same for its MPT-760M run (16 H100s in 2 nodes, 384 sequences,
   68,551 tokens per second per GPU) with a GPT of its shape (``gpt-760m``).
3. Where ``TPU_PLAN_PYTHON`` names a Python with libtpu (``pip install
   "meshkit[tpu]"``), ``python -m recipes.plan --targets v5e-256`` with it: the v5e
   plan through the TPU compiler, with the flash kernel; and MaxText's 16B model on one
   v5e-256 as its v5e table ran it (6 sequences of 2048 per chip, FSDP over the 256
   chips, every layer recomputed, flash attention), planned through the TPU compiler
   from its architecture written as a Llama ``config.json``, against the 61.10% MFU
   the table reports.
"""

from __future__ import annotations

import dataclasses
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
from meshkit.plan._efficiency import PUBLISHED_RUNS


@dataclasses.dataclass(frozen=True)
class MptRun:
    """A row of LLM Foundry's H100 BF16 table at sequence 2048 without activation
    checkpointing (docs/planning.md), planned as a GPT of its shape laid out with FSDP
    over the 8 GPUs of a node and data parallelism across nodes.

    Attributes:
      key: the run's name in the results and the quoted table's.
      name: the run as the table names it.
      model: ``--model`` of the GPT of its shape.
      gpus: H100s, 8 to a node.
      sequences: sequences of 2048 tokens a step.
      tokens_per_second_per_gpu: its measured throughput.
    """

    key: str
    name: str
    model: str
    gpus: int
    sequences: int
    tokens_per_second_per_gpu: int

    @property
    def argv(self) -> list[str]:
        """Its setup for ``python -m meshkit.plan`` (without ``--compiler``)."""
        return [
            "--model", self.model, "--accelerator", "h100", "--devices", str(self.gpus),
            "--slices", str(self.gpus // 8), "--batch-size", str(self.sequences),
            "--length", "2048", "--tensor", "1", "--fsdp", "8", "--remat", "none",
            "--precision", "bf16", "--quiet",
        ]  # fmt: skip

    @property
    def mfu(self) -> float:
        """Its published model FLOPs utilisation, as the planner's calibration holds it."""
        label = f"{self.name}, {self.gpus} x H100"
        return next(run.mfu for run in PUBLISHED_RUNS if run.name == label)

    @property
    def measured_seconds(self) -> float:
        """The step its throughput means for ``sequences`` x 2048 tokens."""
        return self.sequences * 2048 / self.gpus / self.tokens_per_second_per_gpu


MPT_RUNS = (
    MptRun("mpt_1b", "MPT-1B", "gpt-1.3b", 64, 256, 44_402),
    MptRun("mpt_760m", "MPT-760M", "gpt-760m", 16, 384, 68_551),
)
"""MPT-1B on 64 GPUs (data=8 x fsdp=8) and MPT-760M on 16 (data=2 x fsdp=8)."""


MAXTEXT_16B_MFU = next(run.mfu for run in PUBLISHED_RUNS if run.name == "MaxText 16B, 256 x v5e")
"""MaxText's v5e table, 16B on 1x v5e-256: 120 TFLOP/s per chip, 61.10% MFU."""

MAXTEXT_16B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 6144,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
"""MaxText's ``global_parameter_scale=16`` (its llama2 decoder block: RMSNorm, SwiGLU,
RoPE, untied embeddings) as a Llama config: the base width 2048 x 3, 16 x 2 heads of
128, MLP 7168 x 2, 16 x 2 layers, a vocabulary of 32,000: 12.07B parameters."""

MAXTEXT_16B_ARGV = [
    "--length", "2048", "--batch-size", "1536", "--accelerator", "v5e", "--devices", "256",
    "--compiler", "tpu", "--topology", "v5e:16x16", "--tensor", "1", "--fsdp", "256",
    "--remat", "nothing_saveable", "--attention", "pallas", "--quiet",
]  # fmt: skip
"""The v5e table's 16B run as a plan: fsdp=256, remat full, flash attention."""


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


def plan_published_run(
    python: str, argv: list[str], name: str, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A published run's setup planned in a fresh process of ``python`` (its model given
    by ``config``, a Llama ``config.json``, where the planner has no name for it)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "plan.json"
        argv = [*argv, "--json", str(path)]
        if config is not None:
            (Path(scratch) / "config.json").write_text(json.dumps(config))
            argv += ["--hf-config", str(Path(scratch) / "config.json")]
        done = subprocess.run(
            [python, "-m", "meshkit.plan", *argv], capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise SystemExit(f"planning {name} failed:\n{done.stderr[-3000:]}")
        layout = json.loads(path.read_text())["layouts"][0]
    print(done.stdout)
    return layout


def main() -> None:
    planners = [(sys.executable, "cpu")]
    if os.environ.get("GPU_PLAN_PYTHON"):
        planners.append((os.environ["GPU_PLAN_PYTHON"], "gpu"))
    results: dict[str, Any] = {}
    for run in MPT_RUNS:
        results[run.key] = [
            plan_published_run(python, [*run.argv, "--compiler", compiler], run.name)
            for python, compiler in planners
        ]
        results[f"{run.key}_measured_seconds"] = run.measured_seconds
    results["recipe"] = run_recipe()
    if os.environ.get("TPU_PLAN_PYTHON"):
        tpu = os.environ["TPU_PLAN_PYTHON"]
        results["recipe_tpu"] = run_recipe(tpu, "--targets", "v5e-256", "--quiet")
        results["maxtext_16b"] = [
            plan_published_run(tpu, MAXTEXT_16B_ARGV, "MaxText 16B", MAXTEXT_16B_CONFIG)
        ]
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
    v5e through the TPU compiler, where it ran; each of ``MPT_RUNS`` and
    ``maxtext_16b``: the plans of a published run's setup against its measured step."""
    found = {"recipe": _recipe_table(run["recipe"], "python -m recipes.plan")}
    for mpt in MPT_RUNS:
        if mpt.key in run:
            step = run[f"{mpt.key}_measured_seconds"]
            found[mpt.key] = _published_table(run[mpt.key], lambda _, s=step: s, "GPU", mpt.mfu)
    if "recipe_tpu" in run:
        command = "python -m recipes.plan --targets v5e-256  # with libtpu installed"
        found["recipe_tpu"] = _recipe_table(run["recipe_tpu"], command)
    if "maxtext_16b" in run:  # the step the reported MFU means for the model's FLOPs
        found["maxtext_16b"] = _published_table(
            run["maxtext_16b"],
            lambda layout: (
                layout["estimated_step_seconds"] * layout["estimated_mfu"] / MAXTEXT_16B_MFU
            ),
            "chip",
            MAXTEXT_16B_MFU,
        )
    return found


def _published_table(
    layouts: list[dict[str, Any]], measured: Any, device: str, published_mfu: float
) -> str:
    """Plans of a published run's setup against the step it measured (``measured(layout)``)."""
    rows = []
    for layout in layouts:
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
                f"{measured(layout):.3f} s",
                f"**{planned / measured(layout):.2f}**",
                f"{layout['estimated_mfu']:.1%}",
            ]
        )
    header = ["layout", "figures from", f"TFLOP per {device}", f"collectives GiB per {device}"]
    header += ["compute s", "collectives s", "planned step (range)", "measured step"]
    header += ["planned / measured", f"planned MFU (measured {published_mfu:.2%})"]
    return markdown_table(header, rows, "ll" + "r" * 8)


if __name__ == "__main__":
    main()
