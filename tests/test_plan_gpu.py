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


def tied_table_payloads(tmp_path: Path, vocab: int, fsdp: int) -> dict[str, float]:
    """Bytes by collective kind of gpt-125m's step on 8 compile-only H100s, with ``vocab``
    rows in its tied table and the batch over ``data=8/fsdp`` and ``fsdp``."""
    out = tmp_path / f"{vocab}-{fsdp}.json"
    done = subprocess.run(
        [sys.executable, "-m", "meshkit.plan", "--compiler", "gpu", "--accelerator", "h100",
         "--devices", "8", "--model", "gpt-125m", "--length", "128", "--batch-size", "8",
         "--tensor", "1", "--fsdp", str(fsdp), "--remat", "none", "--vocab", str(vocab),
         "--json", str(out), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["layouts"][0]["collective_payload_bytes_by_kind"]


ROWS_BF16 = 1024 * 768 * 2  # 1,024 more rows of a tied table of width 768, in bf16


def grown(tmp_path: Path, fsdp: int) -> dict[str, float]:
    """What 1,024 more table rows add to each kind of collective."""
    small, large = (tied_table_payloads(tmp_path, vocab, fsdp) for vocab in (8192, 9216))
    return {kind: large.get(kind, 0.0) - small.get(kind, 0.0) for kind in {*small, *large}}


def test_xla_gpu_gathers_a_tied_embedding_in_the_compute_dtype(tmp_path: Path) -> None:
    # This small program gathers the table once a step and keeps it for the backward pass.
    # Before the table was pinned to its shards ahead of its gather, the partitioner
    # gathered the float32 parameter before its cast: twice the bytes (the test fails so).
    assert grown(tmp_path, fsdp=8)["all-gather"] == pytest.approx(ROWS_BF16, rel=0.01)


def test_xla_gpu_reduces_a_tied_embeddings_gradient_once_under_data_and_fsdp(tmp_path):
    # data=2,fsdp=4: the lookup's and the logits' gradients of the rows are added on each
    # device, reduce-scattered once over fsdp and their quarter all-reduced once over
    # data, as FSDP moves any parameter; the table is gathered once. Left to the
    # partitioner, each use reduced its own (two reduce-scatters, two all-reduces: the
    # test fails so).
    more = grown(tmp_path, fsdp=4)
    assert more["reduce-scatter"] == pytest.approx(ROWS_BF16, rel=0.01)
    assert more["all-reduce"] == pytest.approx(ROWS_BF16 / 4, rel=0.01)
    assert more["all-gather"] == pytest.approx(ROWS_BF16, rel=0.01)
    assert more.get("all-to-all", 0.0) == more.get("collective-permute", 0.0) == 0.0
