"""Smoke tests: each recipe runs as a user would run it and prints its expected result."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from meshkit.testing import run_processes, write_cifar10, write_mnist


def run_recipe(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "will be removed in meshkit" not in out.stderr, out.stderr  # recipes use today's API
    return out.stdout


@pytest.mark.once  # the recipe picks its own 8 devices
def test_sharding_demo_matches_one_device_loss():
    stdout = run_recipe("recipes.sharding_demo")
    match = re.search(r"loss on 8 devices: (\d+\.\d+)  \(1 device: (\d+\.\d+)\)", stdout)
    assert match and match.group(1) == match.group(2), stdout[-500:]
    assert "params/Dense_0/kernel  (64, 512)  float32  P(None, 'data')  16.0 KiB" in stdout


@pytest.mark.multiprocess
def test_sharding_demo_on_two_processes(tmp_path):
    run_processes(["-m", "recipes.sharding_demo"], log_dir=tmp_path)
    log = (tmp_path / "process_0.log").read_text()
    assert "8 cpu devices in 2 processes" in log
    assert re.search(r"loss on 8 devices: (\S+)  \(1 device: \1\)", log), log[-500:]
    assert "loss on" not in (tmp_path / "process_1.log").read_text()


@pytest.mark.once  # the README's main command; it picks its own devices
def test_data_parallel_learns_the_digits(tmp_path):
    # A third of the default run; the default 200 steps reach 0.98 (nox -s first_hour).
    stdout = run_recipe(
        "recipes.data_parallel", "--steps", "60", "--no-progress", "--workdir", str(tmp_path)
    )
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["test_accuracy"] >= 0.85 and summary["test_examples"] == 360
    assert summary["steps"] == 60 and summary["input"].startswith("resident (replicated")
    assert summary["train_step_compiles"] <= 3  # one per chunk size: 1, auto's probe, its pick
    assert json.loads((tmp_path / "summary.json").read_text()) == summary

    # Rerun as a user would: other settings stop in one line; the same end in one line.
    common = ("recipes.data_parallel", "--no-progress", "--workdir", str(tmp_path))
    changed = subprocess.run(
        [sys.executable, "-m", *common, "--steps", "60", "--learning-rate", "0.01"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert changed.returncode == 1 and changed.stderr.count("\n") == 1, changed.stderr[-2000:]
    assert "learning_rate 0.05 (now 0.01)" in changed.stderr and "--fresh" in changed.stderr
    again = run_recipe(*common, "--steps", "60", "--input", "host")  # input may change
    assert again.strip().splitlines() == [
        f"{tmp_path} already holds this run, done at step 60 (its summary: "
        f"{tmp_path / 'summary.json'}); pass a larger --steps to train on, or --fresh to "
        "start over."
    ]
    fresh = run_recipe(*common, "--steps", "2", "--learning-rate", "0.01", "--fresh")
    restarted = json.loads(fresh.strip().splitlines()[-1])
    assert restarted["steps"] == 2 and restarted["resumed_from"] is None
    assert restarted["hyperparameters"]["learning_rate"] == 0.01


@pytest.mark.once  # the recipe picks its own devices
def test_data_parallel_bf16_micro_batches_and_tensorboard_learn(tmp_path):
    stdout = run_recipe(
        "recipes.data_parallel",
        *("--precision", "bf16", "--microbatches", "4", "--tensorboard"),
        *("--steps", "40", "--no-progress", "--workdir", str(tmp_path)),
    )  # 40 steps: CPUs emulate bfloat16; 100 steps give 0.975, the 200-step run 0.986
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["test_accuracy"] >= 0.8 and summary["train_step_compiles"] <= 3
    assert summary["hyperparameters"]["precision"] == "bf16"
    assert summary["hyperparameters"]["microbatches"] == 4
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["arguments"]["precision"] == "bf16" and config["mesh"] == {"data": 8}
    assert config["devices"]["count"] == 8 and config["versions"]["jax"]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 1000


@pytest.mark.once  # the recipe picks its own devices
@pytest.mark.parametrize(
    ("dataset", "model", "write"),
    [
        ("mnist", "mnist_cnn", lambda d: write_mnist(d, num_train=256, num_test=40)),
        ("cifar10", "cifar_net", lambda d: write_cifar10(d, per_batch=48)),
    ],
)
def test_data_parallel_reads_real_file_formats(dataset, model, write, tmp_path):
    write(tmp_path / "data")
    stdout = run_recipe(
        "recipes.data_parallel",
        "--dataset",
        dataset,
        "--model",
        model,
        "--data-dir",
        str(tmp_path / "data"),
        "--steps",
        "3",
        "--batch-size",
        "64",
        "--no-progress",
        "--workdir",
        str(tmp_path / "run"),
    )
    summary = json.loads(stdout.strip().splitlines()[-1])
    test_examples = 40 if dataset == "mnist" else 48
    assert summary["steps"] == 3 and summary["test_examples"] == test_examples


@pytest.mark.once
@pytest.mark.parametrize(
    "recipe",
    ["data_parallel", "ensemble", "image_classification", "sweep", "transformer_lm", "finetune_lm"],
)
def test_zero_steps_or_micro_batches_are_refused_by_name(recipe, capsys):
    import importlib

    parse_args = importlib.import_module(f"recipes.{recipe}").parse_args
    if recipe == "transformer_lm":  # its warm-up default follows a short run's --steps
        assert parse_args(["--steps", "5"]).warmup_steps == 0
        assert parse_args([]).warmup_steps == 60
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    assert "argument --steps: must be at least 1, got 0" in capsys.readouterr().err
    if recipe != "sweep":
        with pytest.raises(SystemExit):
            parse_args(["--microbatches", "0"])
        assert "argument --microbatches: must be at least 1, got 0" in capsys.readouterr().err
    if recipe not in ("transformer_lm", "finetune_lm"):
        for wrong in ("0", "eight"):
            with pytest.raises(SystemExit):
                parse_args(["--steps-per-dispatch", wrong])
            assert (
                f"argument --steps-per-dispatch: expected a whole number of at least 1 or auto, "
                f"got '{wrong}'" in capsys.readouterr().err
            )


OUT_OF_RANGE = [  # recipe, flag, a value out of its range, what the refusal says
    ("data_parallel", "--batch-size", "0", "must be at least 1, got 0"),
    ("data_parallel", "--eval-every", "0", "must be at least 1, got 0"),
    ("data_parallel", "--checkpoint-every", "-5", "must be at least 1, got -5"),
    ("data_parallel", "--learning-rate", "0", "must be above 0, got 0"),
    ("data_parallel", "--momentum", "1", "must be in [0, 1), got 1"),
    ("data_parallel", "--warmup-steps", "-1", "must be at least 0, got -1"),
    ("ensemble", "--members", "0", "must be at least 1, got 0"),
    ("full_eval", "--train-steps", "-1", "must be at least 1, got -1"),
    ("image_classification", "--image-size", "4", "must be at least 8, got 4"),
    ("image_classification", "--workers", "-1", "must be at least 0, got -1"),
    ("image_classification", "--min-crop", "1.5", "must be in (0, 1], got 1.5"),
    ("image_classification", "--weight-decay", "x", "expected a number, got 'x'"),
    ("lbfgs", "--num-classes", "1", "must be at least 2, got 1"),
    ("lbfgs", "--tol", "-1", "must be above 0, got -1"),
    ("transformer_lm", "--dropout-rate", "1.0", "must be in [0, 1), got 1.0"),
    ("finetune_lm", "--weight-decay", "-1", "must be at least 0, got -1"),
    ("plan", "--length", "0", "must be at least 1, got 0"),
    ("sweep", "--microbatches", "0", "must be at least 1, got 0"),
]


@pytest.mark.once
@pytest.mark.parametrize(("recipe", "flag", "value", "said"), OUT_OF_RANGE)
def test_a_number_out_of_range_is_refused_naming_its_flag(recipe, flag, value, said, capsys):
    """Before anything runs: argparse's two lines (usage, then the flag and the range),
    not a traceback from deep inside the run."""
    import importlib

    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"recipes.{recipe}").parse_args([flag, value])
    assert stopped.value.code == 2
    assert f"argument {flag}: {said}" in capsys.readouterr().err


@pytest.mark.once
def test_help_gives_every_default_zero_included(capsys):
    from recipes.data_parallel import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    for said in ("--seed SEED (default: 0)", "--momentum MOMENTUM (default: 0.9)"):
        assert said in shown
    assert "global batch size (default: 128)" in shown and "--no-progress --model" in shown


@pytest.mark.once
def test_transformer_heads_that_do_not_divide_the_width_are_refused_by_name(capsys):
    from recipes.transformer_lm import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--num-heads", "3"])
    assert "--embed-dim 128 does not split into --num-heads 3 heads" in capsys.readouterr().err


@pytest.mark.once
def test_image_input_and_augmentation_settings_that_conflict_are_refused_in_one_line(capsys):
    from recipes.image_classification import parse_args

    assert parse_args([]).input == "resident" and parse_args([]).augment == "device"
    assert parse_args(["--input", "host"]).augment == "device"  # decoded on the host
    assert parse_args(["--augment", "host"]).input == "host"
    assert parse_args(["--image-size", "160"]).input == "host"  # augmented on the host
    with pytest.raises(SystemExit):
        parse_args(["--input", "resident", "--augment", "host"])
    error = capsys.readouterr().err.strip().splitlines()
    assert "Pass --augment device, or --input host." in error[-1], error


@pytest.mark.once
def test_the_plan_recipe_takes_remat_as_meshkit_plan_does_and_no_cpu_devices(capsys):
    from recipes.plan import parse_args

    assert parse_args(["--remat", "none,nothing_saveable"]).remat == ["none", "nothing_saveable"]
    assert parse_args(["--remat", "none", "dots_saveable"]).remat == ["none", "dots_saveable"]
    with pytest.raises(SystemExit):
        parse_args(["--cpu-devices", "4"])  # each target brings its own device count
    assert "unrecognized arguments: --cpu-devices 4" in capsys.readouterr().err
