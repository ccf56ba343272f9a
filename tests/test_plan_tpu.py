"""The planner through the TPU compiler itself (``nox -s plan_tpu``, which installs
libtpu): layouts the compiler refuses for memory are rows of the plan, two planners run
at once, and libtpu says nothing on a machine without TPUs. Skipped without libtpu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit._plugins import has_tpu_devices, libtpu_installed

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(
        not libtpu_installed(),
        reason='needs libtpu: nox -s plan_tpu (pip install "meshkit[tpu]")',
    ),
]

REPO = Path(__file__).resolve().parents[1]
LIBTPU_NOISE = ("Failed to find host bounds", "unexpected worker hostname", "Source Location")


def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.skipif(has_tpu_devices(), reason="a TPU VM: the compiler would plan for its chips")
def test_the_recipe_plans_the_v5e_pod_with_refused_layouts_as_rows(tmp_path):
    done = run("-m", "recipes.plan", "--targets", "v5e-256", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(noise in done.stderr + done.stdout for noise in LIBTPU_NOISE), done.stderr
    layouts = json.loads((tmp_path / "plan_v5e-256.json").read_text())["layouts"]
    refused = [layout for layout in layouts if layout["error"]]
    assert refused and all("refused it for memory" in layout["error"] for layout in refused)
    assert all(not layout["fits"] and layout["flops_per_device"] is None for layout in refused)
    assert layouts[0]["fits"] and layouts[0]["compiler"] == "XLA:TPU (v5e:16x16)"
    assert any(layout["fits"] and layout["remat"] == "none" for layout in layouts)  # flash
    # 6 FLOPs per parameter and token and attention's 12 x layers x length x width per
    # token (the flash kernel's counted from its shapes), over 256 chips; remat adds the
    # forward pass again, up to 4/3: the 24 scanned layers count as often as they run
    model = (6 * layouts[0]["num_params"] + 12 * 24 * 2048 * 2048) * 256 * 2048 / 256
    for layout in layouts:
        if layout["error"] is None:
            assert 0.95 * model < layout["flops_per_device"] < 1.35 * model, layout


def test_two_planners_at_once_share_libtpu():
    command = [
        sys.executable, "-m", "meshkit.plan", "--model", "gpt-125m", "--length", "256",
        "--batch-size", "8", "--accelerator", "v5e", "--devices", "4", "--compiler", "tpu",
        "--topology", "v5e:2x2", "--tensor", "1", "--remat", "none", "--quiet",
    ]  # fmt: skip
    started = [
        subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in started]
    for process, (out, err) in zip(started, outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
        assert "chosen:" in out and not any(noise in err for noise in LIBTPU_NOISE), err


def test_the_pallas_flash_kernel_compiles_for_a_tpu_and_stores_no_attention_matrix():
    from meshkit.plan import plan_in_subprocess

    temporaries, flops = {}, {}
    for attention in ("xla", "pallas"):
        plan = plan_in_subprocess(
            ["--model", "gpt-125m", "--length", "1024", "--batch-size", "8", "--accelerator",
             "v5e", "--devices", "4", "--compiler", "tpu", "--topology", "v5e:2x2", "--tensor",
             "1,2", "--fsdp", "2", "--remat", "none", "--quiet", "--attention", attention],
            timeout=600,
        )  # fmt: skip
        assert all(layout["error"] is None for layout in plan["layouts"])
        temporaries[attention] = {
            layout["layout"]: layout["temp_bytes_per_device"] for layout in plan["layouts"]
        }
        flops[attention] = {
            layout["layout"]: layout["flops_per_device"] for layout in plan["layouts"]
        }
    # model=2 splits the heads: the kernel runs per device under shard_map either way
    for layout, xla in temporaries["xla"].items():
        assert temporaries["pallas"][layout] < xla - 2**30, (layout, temporaries)
        # the kernels' custom calls counted as XLA's attention products (13% of the step;
        # 0.3% apart: softmax's elementwise work)
        assert flops["pallas"][layout] == pytest.approx(flops["xla"][layout], rel=0.01)


def test_maxtext_16b_planned_at_its_published_setup_reaches_its_published_mfu(tmp_path):
    """MaxText's 16B on one v5e-256 as its v5e table ran it (docs/planning.md), from its
    architecture as a Llama config, through the TPU compiler."""
    from benchmarks.plan_recipe import MAXTEXT_16B_ARGV, MAXTEXT_16B_CONFIG, MAXTEXT_16B_MFU
    from meshkit.plan import plan_in_subprocess

    config = tmp_path / "config.json"
    config.write_text(json.dumps(MAXTEXT_16B_CONFIG))
    argv = [*MAXTEXT_16B_ARGV, "--hf-config", str(config)]
    layout = plan_in_subprocess(argv, timeout=900)["layouts"][0]
    assert layout["fits"] and layout["compiler"] == "XLA:TPU (v5e:16x16)"
    assert layout["num_params"] == 12_070_557_696  # heads of 128 in a width of 6144
    # the planned step against the measured one is the published MFU over the planned
    assert MAXTEXT_16B_MFU / layout["estimated_mfu"] == pytest.approx(1, abs=0.25)
    # every layer recomputed: the forward pass again, flash kernels included
    assert layout["estimated_hfu"] / layout["estimated_mfu"] == pytest.approx(4 / 3, rel=0.1)


def test_per_layer_activations_match_the_count_on_the_tpu_compiler():
    """One more GPT layer (s=2048, h=1024, a=8, one sequence per chip, bf16), bare and in
    the train step, against the count of Korthikanti et al. 2022 without dropout, each
    difference a named tensor (docs/planning.md has the table)."""
    from benchmarks.activations import SHAPE, per_layer
    from meshkit import plan
    from meshkit.plan._workloads import korthikanti_activation_bytes

    target = plan.Target("v5e", 4, compiler="tpu", topology="v5e:2x2")
    s, h, a = SHAPE["length"], SHAPE["width"], SHAPE["heads"]
    recomputed = 12 * s * h  # the two LayerNorm outputs and the GELU output, bf16
    weights = 12 * h * h * 2  # the layer's weights cast to bf16 in the step
    xla = per_layer(target, "xla")
    counted = korthikanti_activation_bytes(length=s, batch=1, width=h, heads=a, softmax_bytes=4)
    assert xla["step_per_layer_bytes"] == pytest.approx(counted, rel=0.10)
    assert xla["bare_per_layer_bytes"] == pytest.approx(counted - recomputed, rel=0.05)
    assert xla["step_per_layer_bytes"] == pytest.approx(
        xla["bare_per_layer_bytes"] + weights, rel=0.05
    )
    flash = per_layer(target, "pallas")
    fused = korthikanti_activation_bytes(length=s, batch=1, width=h, heads=a, fused_attention=True)
    kernel_layout = 6 * s * h  # q, k, v once more, heads first for the kernel
    assert flash["bare_per_layer_bytes"] == pytest.approx(
        fused - recomputed + kernel_layout, rel=0.10
    )
    assert flash["step_per_layer_bytes"] == pytest.approx(
        flash["bare_per_layer_bytes"] + weights, rel=0.10
    )
    assert flash["step_per_layer_bytes"] < xla["step_per_layer_bytes"] / 2


def test_with_libtpu_installed_a_recipe_says_nothing_of_it_and_meshkit_sets_no_variable(tmp_path):
    from test_imports import ENVIRONMENT_AFTER_IMPORT

    from meshkit.plan._environment import COMPILE_ONLY_ENVIRONMENT

    done = run("-m", "recipes.data_parallel", "--steps", "2", "--no-progress",
               "--workdir", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(noise in done.stderr + done.stdout for noise in LIBTPU_NOISE), done.stderr
    library, planning = json.loads(
        run("-c", ENVIRONMENT_AFTER_IMPORT).stdout.strip().splitlines()[-1]
    )
    assert library == []  # importing meshkit; importing meshkit.plan, the planner's own:
    assert set(planning) <= set(COMPILE_ONLY_ENVIRONMENT)
