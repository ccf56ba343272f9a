"""JAX's C++ abort report, kept out of a multi-process job's output: the filter, and a
process killed without a word in a real 2-process job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshkit._runtime.abort import AbortFilter
from meshkit.launch import free_port, process_environment

# What a process printed when the coordination service's process was killed (jaxlib 0.10;
# long lines continue after a backslash).
SERVICE_GONE = b"""\
W1127 11:32:11.217193    8823 preemption_sync_manager.cc:147] Failed to retrieve preemption \
notice from coordination service: UNAVAILABLE: Socket closed
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/GetKeyValue:
E1127 11:32:11.217523    8823 coordination_service_agent.cc:289] Polled an error from \
coordination service (this can be an error from this or another task).
F1127 11:32:11.217527    8823 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. This most likely indicates that another task died.
*** Check failure stack trace: ***
    @     0x7ff6b2e40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7ff6aef040ee  xla::CoordinationServiceAgent::SetError()
    @     0x7ff6baa551f5  (unknown)
"""
# ... and what the process hosting the service printed when another one was killed.
HEARTBEATS = b"""\
E1127 11:31:40.499156    8686 coordination_service.cc:1549] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped \
sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.
F1127 11:31:40.499710    8697 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors.
*** Check failure stack trace: ***
    @     0x7ff237040634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""


class Output:
    def __init__(self, process_id: str = "1"):
        self.written: list[bytes] = []
        self.filter = AbortFilter(process_id, self.written.append)

    @property
    def text(self) -> str:
        return b"".join(self.written).decode()


@pytest.mark.once
@pytest.mark.parametrize(
    ("report", "gist"),
    [
        (SERVICE_GONE, "process 0, which runs the job's coordination service, stopped answering"),
        (HEARTBEATS, "process 1 stopped sending heartbeats"),
    ],
)
def test_the_runtimes_fatal_report_becomes_one_line_naming_the_lost_process(report, gist):
    out = Output()
    out.filter.feed(b"step 10, loss 0.25\n")
    assert out.text == "step 10, loss 0.25\n"  # copied at once
    for at in range(0, len(report), 37):  # in pieces, as a pipe delivers it
        out.filter.feed(report[at : at + 37])
    assert out.text == "step 10, loss 0.25\n"  # held until the output is quiet or ends
    out.filter.close()
    lines = out.text.splitlines()
    assert len(lines) == 2
    assert lines[1].startswith(f"[meshkit] Process 1 stopped: JAX's distributed runtime ended it "
                               f"because {gist}.")  # fmt: skip
    lines_left_out = len(report.splitlines())
    assert f"The runtime's {lines_left_out}-line C++ report is left out" in lines[1]
    assert "MESHKIT_RUNTIME_REPORTS=1 shows it" in lines[1]


@pytest.mark.once
def test_a_trace_printed_after_a_pause_goes_with_its_report():
    # On a busy machine the runtime's stack trace may come after the quiet that judged
    # the fatal message: it belongs to the report said in one line, and goes too.
    out = Output("0")
    fatal, trace = HEARTBEATS.split(b"*** Check failure")
    out.filter.feed(fatal)
    out.filter.quiet()
    out.filter.feed(b"*** Check failure" + trace + b"    @     0x7ff2  (unknown)\n")
    out.filter.feed(b"srun: error: vm: task 0: Aborted\n")
    out.filter.close()
    lines = out.text.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[meshkit] Process 0 stopped")
    assert lines[1] == "srun: error: vm: task 0: Aborted"


@pytest.mark.once
def test_everything_else_is_copied_unchanged():
    out = Output()
    out.filter.feed(b"\r 10%|#         | 1/10\r 20%|##        | 2/10")
    assert out.text == "\r 10%|#         | 1/10\r 20%|##        | 2/10"  # progress: at once
    warning = b"W1127 11:33:55.056993    9107 preemption_notifier.cc:90] SIGTERM caught\n"
    out.filter.feed(warning + b"Traceback (most recent call last):\n")
    out.filter.quiet()  # a C++ log block without the fatal message: copied a moment later
    out.filter.feed(b"E")  # may become a C++ log line: held
    out.filter.feed(b"poch 3 done\nI am a line\n")
    out.filter.feed(b"E1127 11:33:55.1 1 x.cc:1] cut")
    out.filter.close()
    assert out.text == (
        "\r 10%|#         | 1/10\r 20%|##        | 2/10"
        + warning.decode()
        + "Traceback (most recent call last):\nEpoch 3 done\nI am a line\n"
        + "E1127 11:33:55.1 1 x.cc:1] cut"
    )


LOOP = textwrap.dedent("""
    import os, sys, time
    import meshkit
    meshkit.distributed.initialize()
    import jax, numpy as np
    from jax.experimental import multihost_utils
    for step in range(2000):
        multihost_utils.process_allgather(np.float32(step))  # a collective with the victim
        if step == 5 and jax.process_index() == int(sys.argv[2]):
            open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(0.02)
""")


def wait_for_pid(pid_file: Path, *processes: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 90
    while not pid_file.exists() or not pid_file.read_text():
        assert all(process.poll() is None for process in processes)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(pid_file.read_text())


@pytest.mark.multiprocess
@pytest.mark.exclusive  # a survivor's timing: with no other test's processes beside it
def test_a_process_killed_without_a_word_is_named_by_the_launcher_in_one_line(tmp_path: Path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    command = [sys.executable, "-m", "meshkit.launch", "-n", "2", "--devices-per-process", "1"]
    command += ["--", sys.executable, str(script), str(tmp_path / "pid"), "1"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.kill(wait_for_pid(tmp_path / "pid", launcher), signal.SIGKILL)
    killed = time.monotonic()
    output, _ = launcher.communicate(timeout=60)
    took = time.monotonic() - killed
    lines = [line for line in output.decode().splitlines() if "[Gloo] Rank" not in line]
    assert launcher.returncode == 128 + signal.SIGKILL
    assert took < 5, lines  # not the 10 s heartbeat timeout, nor the 5 s grace
    assert lines == [
        "[launch] process 1 was ended by SIGKILL (the out-of-memory killer and kill -9 send "
        "it; see dmesg or the scheduler's events); stopping process(es) 0 now (SIGKILL), which "
        "cannot go on without it. Rerun the same command to resume from the newest checkpoint"
    ]


SURVIVOR_SAYS = {
    # process 0, the coordination service, killed: process 1's runtime ends it at once
    # with its C++ report, which the filter makes one line
    0: (-signal.SIGABRT, "[meshkit] Process 1 stopped: JAX's distributed runtime ended it "
        "because process 0, which runs the job's coordination service, stopped answering. A "
        "process that ends without a word of its own was killed"),
    # process 1 killed: process 0's next collective fails before the heartbeat timeout
    1: (1, "[meshkit] Process 0 stopped: a collective lost its connection to another process "
        "(ValueError: UNKNOWN: Gloo AllGather failed: "),
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.exclusive  # a survivor's timing: with no other test's processes beside it
@pytest.mark.parametrize("victim", [0, 1])
def test_without_a_launcher_the_survivor_says_one_line(tmp_path: Path, victim: int):
    """As under srun, or with hosts started by hand: one process is killed with SIGKILL."""
    coordinator = f"127.0.0.1:{free_port()}"
    processes, logs = [], []
    for rank in range(2):
        logs.append((tmp_path / f"process_{rank}.log").open("wb"))
        env = process_environment(rank, 2, 1, coordinator)
        env.pop("MESHKIT_RUNTIME_REPORTS", None)
        command = [sys.executable, "-c", LOOP, str(tmp_path / "pid"), str(victim)]
        processes.append(
            subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT)
        )
    os.kill(wait_for_pid(tmp_path / "pid", *processes), signal.SIGKILL)
    code, said = SURVIVOR_SAYS[victim]
    survivor = 1 - victim
    assert processes[survivor].wait(timeout=30) == code
    for log in logs:
        log.close()
    time.sleep(0.5)  # the filter writes its line as the process's output ends
    lines = (tmp_path / f"process_{survivor}.log").read_text().splitlines()
    lines = [line for line in lines if "[Gloo] Rank" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(said)
    assert "left out (MESHKIT_RUNTIME_REPORTS=1 shows it)" in lines[0]
