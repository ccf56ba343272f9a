"""Several processes in ``fit``: a failure on any one ends the job in seconds; Ctrl-C saves.

Each test runs a tiny ``fit`` (a linear model on random data, 2 processes × 2 devices)
written to a file, so that start-up dominates and the tests stay a few seconds long.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshkit import train
from meshkit.testing import start_processes

# Signals, heartbeats, stalls and timed dispatches: with no other test's processes beside them.
pytestmark = [pytest.mark.multiprocess, pytest.mark.exclusive]

# python train.py WORKDIR FAIL_ON HOW: trains "forever"; process FAIL_ON (-1: none) raises
# on reading its 161st row (step 21), as a corrupt record would make it, or with HOW
# "stall" waits there forever, as a dead file server would make it.
TRAIN = textwrap.dedent("""
    import sys
    import threading

    import meshkit

    meshkit.distributed.initialize()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from meshkit import data, train

    workdir, fail_on, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rows_read = 0


    def transform(record, rng):
        global rows_read
        rows_read += 1
        if jax.process_index() == fail_on and rows_read > 160:
            if how == "stall":
                threading.Event().wait()  # a read that never returns
            raise RuntimeError(f"a corrupt record on process {fail_on}")
        return record


    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    rng = np.random.default_rng(0)
    source = data.ArraySource(
        {"image": rng.normal(size=(256, 4)).astype(np.float32), "label": rng.integers(0, 2, 256)}
    )
    pipeline = data.TrainPipeline(
        source, global_batch_size=16, sharding=sharding, transform=transform
    )
    model = train.linen_model(nn.Dense(2), jnp.zeros((1, 4)))
    state = train.create_train_state(model, optax.sgd(0.1), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    result = train.fit(
        state, step, pipeline, num_steps=10**6, workdir=workdir,
        checkpoints=train.Checkpoints(every=10), logging=train.Logging(every=5, progress=False),
    )
    print(f"stopped after step {result.step}, preempted={result.preempted}", flush=True)
    sys.exit(train.PREEMPTED_EXIT_CODE if result.preempted else 0)
""")


def write_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return script


def launch(
    tmp_path: Path, fail_on: int, *launcher_args: str, how: str = "raise", processes: int = 2
) -> tuple[int, str, float]:
    """Runs the script under ``python -m meshkit.launch``: exit code, output, seconds."""
    command = [sys.executable, "-m", "meshkit.launch", "-n", str(processes), "-d", "2"]
    command += ["--timeout", "90", *launcher_args, "--", sys.executable]
    start = time.monotonic()
    result = subprocess.run(
        [*command, str(write_script(tmp_path)), str(tmp_path / "work"), str(fail_on), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "MESHKIT_STALL_TIMEOUT": "4"},
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - start


def test_a_raise_on_process_0_ends_the_job_at_once_with_its_code(tmp_path: Path):
    # The reported case: process 0 cannot append metrics.jsonl. It used to wait 300 s in
    # jax.distributed's shutdown while process 1 waited for it in the next step.
    (tmp_path / "work" / "metrics.jsonl").mkdir(parents=True)
    code, out, seconds = launch(tmp_path, -1)
    assert code == 1, out[-3000:]
    assert seconds < 15, out[-3000:]
    assert "[0] IsADirectoryError: [Errno 21] Is a directory" in out
    # The other process says in one line why it stops, then the real error comes last.
    lines = [line for line in out.splitlines() if "[Gloo]" not in line]
    assert "[1] [meshkit] Process 1 stopping: process 0 failed with IsADirectoryError" in out
    assert lines[-1].startswith(
        "[0] [meshkit] Process 0 failed with IsADirectoryError: [Errno 21] Is a directory"
    ), out[-3000:]
    assert lines[-1].endswith("exiting with code 1; the other processes stop too.")
    assert "Terminating process" not in out and "Gloo AllGather failed" not in out
    assert len(lines) < 40, out


def test_a_raise_on_process_1_ends_the_job_without_the_launchers_help(tmp_path: Path):
    # --grace 60: the launcher does not stop process 0, which must notice by itself, as
    # it would under srun: process 1 announces its failure before it exits.
    code, out, seconds = launch(tmp_path, 1, "--grace", "60")
    assert code == 1, out[-3000:]
    assert seconds < 15, out[-3000:]
    assert "[1] RuntimeError: a corrupt record on process 1" in out
    # The traceback says which example the transform was reading, as in one process.
    assert re.search(
        r"\[1\] \[meshkit\] while the transform function read source index \d+ of ArraySource", out
    ), out[-3000:]
    assert "[0] [meshkit] Process 0 stopping: process 1 failed with RuntimeError" in out
    lines = [line for line in out.splitlines() if "[Gloo]" not in line]
    assert lines[-1] == (
        "[1] [meshkit] Process 1 failed with RuntimeError: a corrupt record on process 1; "
        "exiting with code 1; the other processes stop too."
    ), out[-3000:]
    assert "Terminating process" not in out and "[launch]" not in out
    assert "stopped after step" not in out


@pytest.mark.parametrize("processes", [1, 2])
def test_a_stalled_process_ends_the_job_naming_where_it_waits(tmp_path: Path, processes: int):
    # Process 1's input never returns at step 21; process 0 waits for it in the step's
    # collective. Both are alive, so heartbeats alone would wait forever. With one
    # process, its own input stalls.
    stalled = processes - 1
    code, out, seconds = launch(
        tmp_path, stalled, "--grace", "60", how="stall", processes=processes
    )
    lines = [line for line in out.splitlines() if "[Gloo]" not in line]
    assert code == 1, out[-3000:]
    assert seconds < 40, out[-3000:]  # a 4 s limit (MESHKIT_STALL_TIMEOUT), then at once
    assert re.match(
        rf"\[{stalled}\] \[meshkit\] Process {stalled} stalled: no progress for 4 s at step "
        r"\d+, waiting for its next input batch\. The limit is Dispatch\(stall_timeout=\) or "
        r"MESHKIT_STALL_TIMEOUT \(4 s\); exiting with code 1",
        lines[-1],
    ), out[-3000:]
    assert f"[{stalled}] Where the main thread waits" in out  # then the stack, for the cause
    if processes == 2:
        assert "[0] [meshkit] Process 0 stopping: process 1 failed with StallError" in out


def test_ctrl_c_on_one_process_saves_on_both_at_the_same_step(tmp_path: Path):
    # Without a launcher (srun, hosts started by hand) the SIGINT reaches the process
    # itself: fit turns it into the SIGTERM that JAX's preemption service synchronises.
    work = tmp_path / "work"
    group = start_processes(
        [str(write_script(tmp_path)), str(work), "-1", "none"],
        devices_per_process=2,
        log_dir=tmp_path / "logs",
    )
    try:
        deadline = time.monotonic() + 60
        while not (work / "checkpoints" / "10").is_dir():
            assert group.processes[0].poll() is None, group.log(0)[-3000:]
            assert time.monotonic() < deadline, group.log(0)[-3000:]
            time.sleep(0.05)
        group.processes[1].send_signal(signal.SIGINT)
        codes = group.wait(60, check=False)
    finally:
        group.kill()
    logs = [group.log(0), group.log(1)]
    assert codes == [train.PREEMPTED_EXIT_CODE] * 2, logs[0][-2000:] + logs[1][-2000:]
    assert "Ctrl-C: saving a checkpoint at the next step" in logs[1]
    last = [line for line in logs[0].splitlines() if line.startswith("stopped after step")]
    assert last == [line for line in logs[1].splitlines() if line.startswith("stopped after")]
    saved = max(int(path.name) for path in (work / "checkpoints").iterdir())
    assert last == [f"stopped after step {saved}, preempted=True"]
    assert saved > 10


def test_ctrl_c_to_the_launcher_saves_on_every_process_and_exits_75(tmp_path: Path):
    work = tmp_path / "work"
    command = [sys.executable, "-m", "meshkit.launch", "-n", "2", "-d", "2", "--timeout", "90"]
    launcher = subprocess.Popen(
        [*command, "--", sys.executable, str(write_script(tmp_path)), str(work), "-1", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (work / "checkpoints" / "10").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == train.PREEMPTED_EXIT_CODE, out[-3000:]
    saved = max(int(path.name) for path in (work / "checkpoints").iterdir())
    assert sorted(line for line in out.splitlines() if "stopped after step" in line) == [
        f"[{rank}] stopped after step {saved}, preempted=True" for rank in range(2)
    ]
