"""A workdir belongs to one run at a time, and meshkit writes only what is its own: the
recipes' command line as a user types it, refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit import train
from meshkit._workdir import MARKER, claimed, release_workdir
from meshkit.sweep._run import SWEEP_FILES

pytestmark = pytest.mark.once  # files and locks, whatever the devices

HOLD = """
import sys, time
from meshkit import train
train.claim_workdir(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def data_parallel(workdir: Path, *extra: str) -> str:
    """The recipe run as a user types it, refused: the one line it prints (nothing trains)."""
    command = ["-m", "recipes.data_parallel", "--workdir", str(workdir), "--steps", "2", *extra]
    out = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 1 and not out.stdout, (out.stdout, out.stderr[-3000:])
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def test_a_second_run_into_a_held_workdir_names_the_first_and_a_killed_one_holds_nothing(
    tmp_path: Path,
):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        message = data_parallel(tmp_path, "--learning-rate", "0.01")
        assert message.startswith(f"The workdir {tmp_path} is in use by another run: pid ")
        assert f"pid {holder.pid} on " in message and "choose another workdir" in message
        assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER]  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # A killed run's lock dies with it: the next run takes the workdir and names itself.
    train.claim_workdir(tmp_path)
    try:
        assert json.loads((tmp_path / MARKER).read_text())["pid"] == os.getpid()
    finally:
        release_workdir(tmp_path)


def test_a_users_own_files_are_refused_by_name_and_kept(tmp_path: Path):
    mine = {"config.json": '{"lr": 3}', "metrics.jsonl": "epoch,loss\n", "summary.json": "{}"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    message = data_parallel(tmp_path)
    assert message == (
        f"The workdir {tmp_path} holds config.json, metrics.jsonl and summary.json, which "
        f"meshkit did not write (the folder has no {MARKER} marker), and a run would "
        "overwrite them: choose a new or empty workdir."
    )
    assert {name: (tmp_path / name).read_text() for name in mine} == mine
    assert not (tmp_path / MARKER).exists()


def test_fresh_never_deletes_a_users_checkpoints_folder(tmp_path: Path):
    weights = tmp_path / "checkpoints" / "model_weights.bin"
    weights.parent.mkdir()
    weights.write_bytes(b"\1\2\3")
    assert "holds checkpoints, which meshkit did not write" in data_parallel(tmp_path, "--fresh")
    assert weights.read_bytes() == b"\1\2\3"


def test_fresh_deletes_what_a_run_wrote_and_nothing_else(tmp_path: Path):
    train.claim_workdir(tmp_path)  # a meshkit workdir, as a run leaves it
    release_workdir(tmp_path)
    for name in ("checkpoints/4", "checkpoints/8.damaged", "stage_0/checkpoints/4", "notes/a"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "sweep.json", "my_data.npz", "checkpoints/x"):
        (tmp_path / name).write_text("{}")
    train.claim_workdir(tmp_path, writes=SWEEP_FILES, fresh=True)
    release_workdir(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [MARKER, "checkpoints", "checkpoints/x", "my_data.npz", "notes", "notes/a"]


def test_a_workdir_an_older_meshkit_wrote_is_taken_as_its_own(tmp_path: Path):
    (tmp_path / "checkpoints" / "60").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps({"versions": {"meshkit": "0.1.0"}}))
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 2.3}\n')
    (tmp_path / "summary.json").write_text("{}")
    with claimed(tmp_path):
        assert (tmp_path / MARKER).exists()


@pytest.mark.multiprocess
@pytest.mark.exclusive  # both processes must say it before the launcher's grace period ends
@pytest.mark.once(8)  # the multi-process pass (which starts with 8 devices)
def test_two_processes_take_a_workdir_once_and_are_refused_together(tmp_path: Path):
    """Process 0 takes the lock and tells process 1 the outcome (a collective), so both
    stop at the same point with the same line, and it is the job's last."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        command = ["-m", "recipes.data_parallel", "--workdir", str(tmp_path), "--steps", "2"]
        out = subprocess.run(
            [sys.executable, "-m", "meshkit.launch", "-n", "2", "-d", "4", "--", sys.executable,
             *command],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The tasks' lines, prefixed, without the Gloo connection notes JAX's CPU collectives
    # print from their own threads (their order against other lines is not kept).
    streams = [
        [line for line in text.splitlines() if line.strip() and "[Gloo]" not in line]
        for text in (out.stdout, out.stderr)
    ]
    assert out.returncode == 1, streams
    refusals = [line for lines in streams for line in lines if "is in use by another" in line]
    assert {line[:4] for line in refusals} == {"[0] ", "[1] "}, streams
    assert all(f"pid {holder.pid} on " in line for line in refusals), refusals
    assert all(lines[-1] in refusals for lines in streams if lines), streams  # last words
