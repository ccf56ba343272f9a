"""The path real users take: the docs' SLURM scripts, preemption, requeue and failures,
run on a one-node SLURM cluster started for these tests (``nox -s slurm``).

Every ``sbatch`` script of docs/launch.md and docs/checkpoints.md runs as written, but
for what a one-node CPU cluster cannot honour, substituted by ``fit_to_fixture``:

- paths: the virtualenv, the clone, ``~/`` and ``/project/$USER/`` (which get a small
  CIFAR-10 in the standard pickle format, as a user's data would be);
- resources: one node, 2 tasks where the script has several (1 where it has one), no
  GPUs, memory, account or cores per task; ``module`` is a no-op;
- run length: ``--steps`` and ``--checkpoint-every``.

Tasks run on fake CPU devices (``JAX_NUM_CPU_DEVICES``: 2 tasks × 4, or 1 × 8), in
the environment ``sbatch`` passes on, as a user's exported variables would be.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from slurm_cluster import SlurmCluster, unavailable
from test_failures_processes import TRAIN

from meshkit.testing._files import write_cifar10
from meshkit.train._chunks import MAX_PROBE_STEPS

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
STEPS = 24
LAUNCHER = [sys.executable, "-m", "meshkit.launch", "-n", "2", "-d", "4", "--"]
TIMING = {"steps_per_second", "input_wait_fraction", "input_startup_seconds", "wall_seconds"}
PEER_FAILED = "[meshkit] Process 0 stopping: process 1 failed with RuntimeError"
FAILED_LAST = (
    "[meshkit] Process 1 failed with RuntimeError: a corrupt record on process 1; exiting "
    "with code 1; the other processes stop too."
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no test SLURM cluster: {reason}")
    started = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workdir of ``meshkit.launch -n 2 -d 4`` running the docs scripts' command."""
    root = site(tmp_path_factory.mktemp("reference"))
    command = srun_command(fit_to_fixture(docs_scripts()["one task per GPU"], root))
    command[-1] = str(root / "launcher")
    launched = subprocess.run(
        [*LAUNCHER, sys.executable, *command[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert launched.returncode == 0, launched.stderr[-4000:]
    return root / "launcher"


def docs_scripts() -> dict[str, str]:
    """The ``sbatch`` scripts of the docs, by the name the tests use."""
    blocks = []
    for page in ("launch.md", "checkpoints.md"):
        text = (REPO / "docs" / page).read_text()
        blocks += [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "#SBATCH" in b]
    names = ["one task", "one task per GPU", "one task per node", "requeue"]
    assert len(blocks) == len(names), [block.splitlines()[:3] for block in blocks]
    return dict(zip(names, blocks, strict=True))


def site(root: Path) -> Path:
    """A home and a project folder with CIFAR-10 files in them."""
    for folder in (root / "home" / "data", root / "project"):
        write_cifar10(folder / "cifar-10-batches-py", per_batch=256)
    return root


def fit_to_fixture(
    script: str, root: Path, *, steps: int = STEPS, every: int = 8, time_limit: str = ""
) -> str:
    """The script with the substitutions listed in this module's docstring."""
    nodes = int(re.search(r"--nodes=(\d+)", script).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    per_node = int(re.search(r"--ntasks-per-node=(\d+)", script).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    tasks = 2 if nodes * per_node > 1 else 1
    out = []
    for original in script.splitlines():
        if re.match(r"#SBATCH --(gres|mem|account|cpus-per-task)=", original):
            continue
        line = re.sub(r"--nodes=\d+", "--nodes=1", original)
        line = re.sub(r"--ntasks-per-node=\d+", f"--ntasks-per-node={tasks}", line)
        if time_limit:
            line = re.sub(r"--time=\S+", f"--time={time_limit}", line)
        line = line.replace("~/envs/meshkit", sys.prefix).replace("cd ~/meshkit", f"cd {REPO}")
        line = line.replace("~/", f"{root}/home/").replace("/project/$USER", f"{root}/project")
        line = re.sub(r"--steps \d+", f"--steps {steps}", line)
        out.append(re.sub(r"--checkpoint-every \d+", f"--checkpoint-every {every}", line))
    # After the directives: sbatch reads none after the first command.
    last = max(i for i, line in enumerate(out) if line.startswith("#SBATCH"))
    out.insert(last + 1, "module() { :; }  # no environment modules in the test cluster")
    return "\n".join(out) + "\n"


def job_environment(cluster: SlurmCluster, devices: int = 4, **extra: str) -> dict[str, str]:
    """What a user's shell would pass on: the virtualenv active, fake CPU devices."""
    path = f"{sys.prefix}/bin:{cluster.env.get('PATH', '')}"
    env = {**cluster.env, "PATH": path, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    env.pop("MESHKIT_TEST_DEVICES", None)
    return {**env, **extra}


def submit(cluster: SlurmCluster, script: str, folder: Path, env: dict[str, str]) -> str:
    """``sbatch`` from ``folder``; returns the job id."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.sh").write_text(script)
    return cluster.run(["sbatch", "--parsable", "job.sh"], cwd=folder, env=env).stdout.strip()


def state(cluster: SlurmCluster, job: str) -> str:
    """The job's state (``PENDING``, ``RUNNING``...), or ``""`` once it has left the queue."""
    return cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()


def wait_until(condition: Callable[[], bool], what: str, timeout: float, folder: Path) -> float:
    """Seconds until ``condition()``; fails with the job's output after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"waited {timeout} s for {what}; output:\n{output(folder)[-4000:]}")
        time.sleep(0.2)
    return time.monotonic() - start


def output(folder: Path) -> str:
    return "".join(path.read_text() for path in sorted(folder.glob("*.out")))


def run_job(cluster: SlurmCluster, script: str, folder: Path, env: dict[str, str]) -> str:
    job = submit(cluster, script, folder, env)
    wait_until(lambda: state(cluster, job) == "", f"job {job}", 240, folder)
    return output(folder)


def srun_command(script: str) -> list[str]:
    """The command after ``srun`` (continuation lines joined)."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("srun "))
    return shlex.split(line)[1:]


def summary(workdir: Path) -> dict[str, Any]:
    """The run's summary without its timings: the clock figures, and what 'auto' measured
    (its choice stays in the input line)."""
    values = json.loads((workdir / "summary.json").read_text())
    values["input"] = re.sub(r" \(auto: .*\)$", "", values["input"])
    return {key: value for key, value in values.items() if key not in TIMING}


def task_lines(text: str) -> list[str]:
    """The job's output without SLURM's own status lines and Gloo's connection notes."""
    noise = ("srun:", "slurmstepd", "[Gloo]")
    return [line for line in text.splitlines() if line.strip() and not line.startswith(noise)]


def test_the_detection_line_reports_slurm_in_every_task(cluster: SlurmCluster):
    text = (REPO / "docs" / "launch.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("srun python -c"))
    result = cluster.run(
        ["bash", "-c", line.replace("srun ", "srun -n 2 ", 1)],
        cwd=REPO,
        env=job_environment(cluster),
        timeout=120,
    )
    assert result.stdout.count("Launch(mode='slurm'") == 2, result.stdout + result.stderr


def test_docs_scripts_train_as_the_launcher_does(
    cluster: SlurmCluster, reference: Path, tmp_path: Path
):
    """The three scripts of docs/launch.md: 2 tasks × 4 devices under SLURM equal
    ``meshkit.launch -n 2 -d 4`` exactly; one task of 8 devices agrees closely."""
    scripts = docs_scripts()
    summaries = {"launcher": summary(reference)}
    for name, devices in (("one task per GPU", 4), ("one task per node", 4), ("one task", 8)):
        root = site(tmp_path / name.replace(" ", "_"))
        script = fit_to_fixture(scripts[name], root)
        out = run_job(cluster, script, root / "job", job_environment(cluster, devices))
        workdir = Path(srun_command(script)[-1])
        assert (workdir / "summary.json").is_file(), out[-4000:]
        summaries[name] = summary(workdir)
        assert summaries[name]["steps"] == STEPS
    assert summaries["one task per GPU"]["processes"] == 2
    assert summaries["one task per GPU"] == summaries["launcher"]
    assert summaries["one task per node"] == summaries["launcher"]
    one, two = summaries["one task"], summaries["launcher"]
    assert one["processes"] == 1 and one["mesh"] == two["mesh"] == {"data": 8}
    for key in ("final_train_loss", "test_loss"):
        assert one[key] == pytest.approx(two[key], rel=1e-4), key
    assert abs(one["test_accuracy"] - two["test_accuracy"]) <= 1 / one["test_examples"]


def train_records(workdir: Path) -> dict[int, tuple[float, float, float]]:
    """Loss, gradient norm and accuracy of each training record, by step."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {
        r["step"]: (r["loss"], r["grad_norm"], r["accuracy"])
        for r in map(json.loads, lines)
        if "loss" in r
    }


def final_digest(workdir: Path) -> dict[str, Any]:
    """The digest of the state saved with the run's last checkpoint (step ``STEPS``)."""
    return json.loads((workdir / "checkpoints" / str(STEPS) / "digest" / "metadata").read_text())


def previous(records: Mapping[int, object], step: int) -> int:
    return max((other for other in records if other < step), default=0)


def test_preempted_twice_the_requeue_script_ends_as_an_uninterrupted_run(
    cluster: SlurmCluster, reference: Path, tmp_path: Path
):
    """The requeue script of docs/checkpoints.md, stopped twice:

    1. ``scancel --signal=TERM``: every task saves at the same step and exits 75, and
       the script requeues its own job;
    2. ``scontrol requeue`` on the restarted run: SIGTERM with the cluster's grace
       period before SIGKILL; the tasks save, and SLURM requeues the job itself.

    The third run resumes from the second save and ends with the values of an
    uninterrupted run."""
    root = site(tmp_path / "requeued")
    script = fit_to_fixture(docs_scripts()["requeue"], root, every=4)
    workdir = Path(srun_command(script)[-1])
    folder = root / "job"
    job = submit(cluster, script, folder, job_environment(cluster, 4))

    def restart_now() -> None:  # a requeued job waits two minutes before it may start
        wait_until(lambda: state(cluster, job) == "PENDING", "the requeue", 60, folder)
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        wait_until(lambda: state(cluster, job) == "RUNNING", "the restart", 60, folder)

    wait_until((workdir / "checkpoints" / "4").is_dir, "checkpoint 4", 240, folder)
    cluster.run(["scancel", "--signal=TERM", job])
    restart_now()
    out = output(folder)
    stops = re.findall(r"Reached preemption sync point, step=(\d+)", out)
    assert len(stops) >= 2 and len(set(stops)) == 1, out[-4000:]  # both tasks, one step
    assert "Exited with exit code 75" in out, out[-4000:]
    first = int(stops[0])

    periodic = (first // 4 + 1) * 4  # the restarted run's first periodic checkpoint
    wait_until((workdir / "checkpoints" / str(periodic)).is_dir, "a new checkpoint", 240, folder)
    cluster.run(["scontrol", "requeue", job])
    restart_now()
    wait_until(lambda: state(cluster, job) == "", "the last run", 240, folder)
    out = output(folder)
    assert "DUE TO JOB REQUEUE" in out, out[-4000:]
    # srun stops passing on the tasks' output once SLURM requeues the job, so what they
    # did then is read from the run's files: a save after the signal, resumed from.
    final = json.loads((workdir / "summary.json").read_text())
    assert final["steps"] == STEPS and periodic <= final["resumed_from"] < STEPS, final
    # Records are means over the steps since the previous record (and checkpoints end
    # an interval): where both runs' intervals match after the restart, so do the values.
    resumed, uninterrupted = train_records(workdir), train_records(reference)
    aligned = [
        step
        for step in set(resumed) & set(uninterrupted)
        if step > final["resumed_from"] and previous(resumed, step) == previous(uninterrupted, step)
    ]
    assert all(resumed[step] == uninterrupted[step] for step in aligned)
    # The state at the end, bit for bit: its digest as saved with the last checkpoint.
    # (When the second stop's save falls inside the last logging interval, as at step 23
    # of 24, no record of the two runs covers the same steps, and the last record's mean,
    # final_train_loss, covers other steps; everything else is compared.)
    assert final_digest(workdir) == final_digest(reference)
    covered = {"resumed_from": None} | ({} if aligned else {"final_train_loss": None})
    assert summary(workdir) | covered == summary(reference) | covered


def test_the_time_limit_warning_usr1_saves_and_requeues(cluster: SlurmCluster, tmp_path: Path):
    """``#SBATCH --signal=USR1@120``: once the time left falls under 120 s, SLURM sends
    SIGUSR1 to every task (within its 30 s check period); they save at one step, exit 75,
    and the script requeues the job."""
    root = site(tmp_path / "warned")
    script = fit_to_fixture(docs_scripts()["requeue"], root, steps=100_000, every=10_000)
    assert "#SBATCH --signal=USR1@120" in script
    workdir = Path(srun_command(script)[-1])
    folder = root / "job"
    job = submit(cluster, script, folder, job_environment(cluster, 4))
    wait_until((workdir / "metrics.jsonl").is_file, "training", 240, folder)
    # Bring the time limit near: 90 s left, under the 120 s of the warning.
    elapsed = cluster.run(["squeue", "-h", "-j", job, "-o", "%M"]).stdout.strip()
    minutes, seconds = (int(part) for part in elapsed.split(":")[-2:])
    limit = (minutes * 60 + seconds + 90 + 59) // 60
    cluster.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}"])
    wait_until(lambda: state(cluster, job) == "PENDING", "the warning and requeue", 120, folder)
    cluster.run(["scancel", job])
    out = output(folder)
    assert "[meshkit] SIGUSR1: saving a checkpoint at the next step" in out, out[-4000:]
    stops = re.findall(r"Reached preemption sync point, step=(\d+)", out)
    assert len(stops) >= 2 and len(set(stops)) == 1, out[-4000:]
    # The agreed step may fall inside a dispatch of several steps: the save follows it.
    saved = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert int(stops[0]) <= saved < int(stops[0]) + MAX_PROBE_STEPS, (stops, saved)
    assert "Exited with exit code 75" in out


def failing_job(cluster: SlurmCluster, tmp_path: Path, fail_on: int, srun_options: str) -> str:
    (tmp_path / "train.py").write_text(TRAIN)
    script = (
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=%x-%j.out\n"
        f"source {sys.prefix}/bin/activate\n"
        f"srun {srun_options} python {tmp_path / 'train.py'} {tmp_path / 'work'} {fail_on} raise\n"
    )
    env = job_environment(cluster, 2, MESHKIT_HEARTBEAT_TIMEOUT="10")
    return submit(cluster, script, tmp_path / "job", env)


@pytest.mark.parametrize("srun_options", ["", "--kill-on-bad-exit=1"])
def test_a_failing_task_ends_the_job_with_its_error_last(
    cluster: SlurmCluster, tmp_path: Path, srun_options: str
):
    job = failing_job(cluster, tmp_path, 1, srun_options)
    folder = tmp_path / "job"
    wait_until(lambda: state(cluster, job) == "RUNNING", "the job to start", 120, folder)
    wait_until(lambda: "Traceback" in output(folder), "the failure", 120, folder)
    seconds = wait_until(lambda: state(cluster, job) == "", "the job to end", 60, folder)
    lines = task_lines(output(folder))
    assert lines[-1] == FAILED_LAST, "\n".join(lines[-30:])
    assert any(line.startswith(PEER_FAILED) for line in lines), "\n".join(lines[-30:])
    assert "Terminating process" not in output(folder)
    assert seconds < 10, seconds


def test_a_task_killed_with_sigkill_ends_the_job_within_the_heartbeat_timeout(
    cluster: SlurmCluster, tmp_path: Path
):
    job = failing_job(cluster, tmp_path, -1, "")
    folder = tmp_path / "job"
    wait_until((tmp_path / "work" / "checkpoints" / "10").is_dir, "training", 120, folder)
    pids = cluster.run(["scontrol", "listpids", job]).stdout.split()
    victim = next(
        int(pid)
        for pid in pids
        if pid.isdigit() and _task_of(int(pid)) == "1" and _is_python(int(pid))
    )
    os.kill(victim, signal.SIGKILL)
    seconds = wait_until(lambda: state(cluster, job) == "", "the job to end", 60, folder)
    assert seconds < 10 + 15, output(folder)[-3000:]  # MESHKIT_HEARTBEAT_TIMEOUT=10
    said = output(folder)
    assert "Check failure stack trace" not in said  # the runtime's report, as one line:
    assert (
        "[meshkit] Process 0 stopped: JAX's distributed runtime ended it because process 1 "
        "stopped sending heartbeats."
        in said
        or "[meshkit] Process 0 stopped: a collective lost its connection to another process"
        in said  # a collective with the killed task may fail first
    ), said[-3000:]


def _task_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [entry for entry in environ if entry.startswith(b"SLURM_PROCID=")]
    return found[0].split(b"=", 1)[1].decode() if found else None


def _is_python(pid: int) -> bool:
    try:
        return b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


SWEEP_STEPS = 10
SWEEP = [sys.executable, "-m", "recipes.sweep", "--steps", str(SWEEP_STEPS), "--no-progress"]


def test_a_sweep_as_a_job_array_merges_into_the_table_of_one_program(
    cluster: SlurmCluster, tmp_path: Path
):
    """The job-array script of docs/sweeps.md as two array tasks of 8 points each; the
    merged table holds each of the 16 points once, with the score it gets when all 16
    train in one program."""
    text = (REPO / "docs" / "sweeps.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    script = next(block for block in blocks if "#SBATCH --array" in block)
    script = fit_to_fixture(script, tmp_path, steps=SWEEP_STEPS)
    script = script.replace("--array=0-3", "--array=0-1")
    folder = tmp_path / "job"
    job = submit(cluster, script, folder, job_environment(cluster, 4))
    wait_until(lambda: state(cluster, job) == "", f"array job {job}", 300, folder)
    slices = sorted((tmp_path / "project" / "sweep").glob("slice_*"))
    assert [path.name for path in slices] == ["slice_0", "slice_1"], output(folder)[-4000:]
    merge_line = next(block for block in blocks if "meshkit.sweep merge" in block).strip()
    merge = shlex.split(merge_line.replace("/project/$USER", str(tmp_path / "project")))
    paths = [str(path) for path in slices]  # the shell's expansion of slice_*
    command = [sys.executable, *merge[1:4], *paths, *merge[5:]]
    merged_run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert merged_run.returncode == 0, merged_run.stderr[-3000:]
    assert "16 trials from 2 sweeps" in merged_run.stdout
    merged = json.loads((tmp_path / "project" / "sweep" / "merged.json").read_text())
    scores = {json.dumps(t["hyperparameters"], sort_keys=True): t for t in merged["trials"]}
    assert len(scores) == 16 and {t["source"] for t in merged["trials"]} == {"slice_0", "slice_1"}

    one_program = subprocess.run(
        [*SWEEP, "--cpu-devices", "8", "--workdir", str(tmp_path / "one_program")],
        cwd=REPO,
        env=job_environment(cluster, 8),
        capture_output=True,
        text=True,
        check=False,
    )
    assert one_program.returncode == 0, one_program.stderr[-3000:]
    together = json.loads((tmp_path / "one_program" / "results.json").read_text())["trials"]
    for trial in together:
        sliced = scores[json.dumps(trial["hyperparameters"], sort_keys=True)]
        assert sliced["score"] == pytest.approx(trial["score"], abs=1 / 360 + 1e-9)
        assert sliced["metrics"]["loss"] == pytest.approx(trial["metrics"]["loss"], rel=1e-3)
