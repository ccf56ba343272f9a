"""The planner through XLA:GPU for compile-only GPUs (``nox -s plan_gpu``, which installs
JAX's CUDA plugin): no GPU and no CUDA libraries, figures from XLA:GPU's own programs.
Skipped without the plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit._plugins import cuda_plugin_installed

pytestmark = [
    pytest.mark.gpu_plan,
    pytest.mark.skipif(
        not cuda_plugin_installed(),
        reason='needs JAX\'s CUDA plugin: nox -s plan_gpu (pip install "meshkit[gpu-plan]")',
    ),
]

REPO = Path(__file__).resolve().parents[1]


def plan(tmp_path: Path, compiler: str) -> tuple[dict, str]:
    out = tmp_path / f"{compiler}.json"
    done = subprocess.run(
        [sys.executable, "-m", "meshkit.plan", "--compiler", compiler, "--accelerator", "h100",
         "--devices", "8", "--slices", "2", "--model", "gpt-125m", "--length", "256",
         "--batch-size", "16", "--tensor", "1", "--fsdp", "4", "--remat", "none",
         "--json", str(out), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["layouts"][0], done.stdout + done.stderr


def test_xla_gpu_plans_compile_only_h100s_beside_xla_cpu(tmp_path: Path) -> None:
    gpu, said = plan(tmp_path, "gpu")
    cpu, _ = plan(tmp_path, "cpu")
    assert "figures from XLA:GPU (compile-only)" in said and "no cost analysis" in said
    assert "Traceback" not in said  # the plugin's CUDA check is skipped without GPUs
    assert gpu["fits"] and gpu.get("error") is None
    # the same state and batch: parameter and optimizer bytes are exact either way
    for key in ("params_bytes_per_device", "optimizer_bytes_per_device", "num_params"):
        assert gpu[key] == cpu[key], key
    # FLOPs counted from XLA:GPU's products agree with XLA:CPU's cost analysis
    assert gpu["flops_per_device"] == pytest.approx(cpu["flops_per_device"], rel=0.1)
    assert 0 < gpu["temp_bytes_per_device"] <= cpu["temp_bytes_per_device"]


def test_with_the_plugin_installed_a_recipe_starts_on_the_cpu_without_its_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "recipes.data_parallel", "--steps", "2", "--no-progress",
         "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The plugin's check of the CUDA libraries fails without them, in a traceback, when
    # JAX starts it; initialize starts JAX on the CPU alone. (The plugin's own "Could not
    # find cuda drivers" lines are printed by `import jax` itself, before any meshkit code.)
    assert "Traceback" not in done.stderr and "Unable to load CUDA" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 2


def test_xla_gpu_gathers_a_tied_embedding_in_the_compute_dtype(tmp_path: Path) -> None:
    # 1,024 more rows of a tied table of width 768: 1.5 MiB more per gather in bf16. This
    # small program gathers the table once a step and keeps it for the backward pass.
    # Before the table was pinned to its shards ahead of its gather, the partitioner
    # gathered the float32 parameter before its cast: twice the bytes (the test fails so).
    def all_gather_bytes(vocab: int) -> float:
        out = tmp_path / f"{vocab}.json"
        done = subprocess.run(
            [sys.executable, "-m", "meshkit.plan", "--compiler", "gpu", "--accelerator", "h100",
             "--devices", "8", "--model", "gpt-125m", "--length", "128", "--batch-size", "8",
             "--tensor", "1", "--fsdp", "8", "--remat", "none", "--vocab", str(vocab),
             "--json", str(out), "--quiet"],
            cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        layout = json.loads(out.read_text())["layouts"][0]
        return layout["collective_payload_bytes_by_kind"]["all-gather"]

    table_rows_bf16 = 1024 * 768 * 2
    grown = all_gather_bytes(8192 + 1024) - all_gather_bytes(8192)
    assert grown == pytest.approx(table_rows_bf16, rel=0.01), grown / table_rows_bf16
