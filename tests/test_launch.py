"""python -m meshkit.launch: environment, rank prefixes, failures, signals, timeouts."""

from __future__ import annotations

import io
import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from meshkit import launch

# Signals, heartbeats, stalls and timed dispatches: with no other test's processes beside them.
pytestmark = [pytest.mark.multiprocess, pytest.mark.exclusive]


def run_launcher(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshkit.launch", *args, "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_each_process_gets_its_rank_and_devices_and_its_lines_are_prefixed():
    code = textwrap.dedent("""
        import os
        for name in ("MESHKIT_PROCESS_ID", "MESHKIT_NUM_PROCESSES", "JAX_NUM_CPU_DEVICES"):
            print(name, os.environ[name])
    """)
    result = run_launcher(code, "--processes", "3", "--devices-per-process", "2")
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == sorted(
        f"[{rank}] {name} {value}"
        for rank in range(3)
        for name, value in (
            ("MESHKIT_PROCESS_ID", rank),
            ("MESHKIT_NUM_PROCESSES", 3),
            ("JAX_NUM_CPU_DEVICES", 2),
        )
    )


def test_the_processes_form_one_jax_runtime(tmp_path: Path):
    # Results go to files: JAX's own threads print to the same pipe at the same time.
    code = textwrap.dedent(f"""
        import os, meshkit
        meshkit.distributed.initialize(cpu_devices=8)  # the launcher's -d 2 wins
        import jax, jax.numpy as jnp, numpy as np
        mesh = meshkit.make_mesh("data=-1")
        rows = meshkit.shard_batch(np.full((2, 1), jax.process_index() + 1.0, np.float32),
                                   meshkit.batch_sharding(mesh), global_batch_size=4)
        total = meshkit.to_host(jax.jit(jnp.sum)(rows))
        out = os.path.join({str(tmp_path)!r}, os.environ["MESHKIT_PROCESS_ID"])
        with open(out, "w") as f:
            f.write(f"{{jax.process_count()}} {{jax.device_count()}} {{float(total)}}")
    """)
    result = run_launcher(code, "-n", "2", "-d", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [(tmp_path / str(rank)).read_text() for rank in range(2)] == ["2 4 6.0"] * 2
    assert "initialize(cpu_devices=8) is ignored" in result.stdout + result.stderr


def test_a_failing_process_stops_the_others_and_sets_the_exit_code():
    code = textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["MESHKIT_PROCESS_ID"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX's preemption notifier does
        time.sleep(600)  # stands in for a process waiting on its peer forever
    """)
    start = time.monotonic()
    result = run_launcher(code, "--grace", "1")
    assert result.returncode == 3
    assert 1 + launch.KILL_AFTER_TERM < time.monotonic() - start < 30  # SIGTERM, SIGKILL
    assert (
        "process 1 exited with code 3 and process(es) 0 still run 1 s later (--grace); "
        "stopping them (SIGTERM, then SIGKILL)"
    ) in result.stderr


# Each process reports the signal it got: a stop request must arrive as SIGTERM, the
# signal JAX's preemption service watches, whichever signal the launcher received.
REPORT_SIGNALS = textwrap.dedent("""
    import signal, sys, time
    def report(signum, frame):
        print("got", signal.Signals(signum).name, flush=True)
        sys.exit(75 if signum == signal.SIGTERM else 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, report)
    print("ready", flush=True)
    time.sleep(600)
""")

# Each process prints its pid, then ignores SIGTERM: only a SIGKILL ends it.
IGNORE_SIGTERM = textwrap.dedent("""
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("pid", os.getpid(), flush=True)
    time.sleep(600)
""")


def spawn_launcher(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit.launch", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_lines(launcher: subprocess.Popen[str]) -> list[str]:
    """The first line each of the two processes printed, in rank order."""
    assert launcher.stdout is not None
    return sorted(launcher.stdout.readline() for _ in range(2))


def start_launcher(code: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Starts the launcher on ``code`` and returns it with the first line of each process."""
    launcher = spawn_launcher(code)
    return launcher, first_lines(launcher)


def is_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_ctrl_c_sigterm_and_hangup_reach_every_process_as_sigterm():
    received = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    launchers = [spawn_launcher(REPORT_SIGNALS) for _ in received]  # side by side
    for launcher, signum in zip(launchers, received, strict=True):
        assert first_lines(launcher) == ["[0] ready\n", "[1] ready\n"]
        launcher.send_signal(signum)
    notes = []
    for launcher, signum in zip(launchers, received, strict=True):
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 75, (signum, err)
        assert sorted(out.splitlines()) == ["[0] got SIGTERM", "[1] got SIGTERM"], signum
        notes.append(err.strip().splitlines())
    # Under load one process may save and exit before the other: the launcher says so,
    # in lines of their own (before or after its note about the signal).
    saved_first = [[line for line in lines if "exited with code 75" in line] for lines in notes]
    signal_notes = [
        [line for line in lines if "exited with code 75" not in line] for lines in notes
    ]
    assert signal_notes == [
        [
            "[launch] Ctrl-C: asking every process to save and stop (SIGTERM); "
            "press Ctrl-C again to kill them"
        ],
        [],
        ["[launch] hangup: asking every process to save and stop (SIGTERM)"],
    ]
    assert all(len(lines) <= 1 for lines in saved_first), saved_first


def test_a_second_ctrl_c_kills_every_process():
    launcher, ready = start_launcher(IGNORE_SIGTERM)
    pids = [int(line.split()[-1]) for line in ready]
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert not any(is_gone(pid) for pid in pids)  # they ignore the SIGTERM
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "second Ctrl-C: killing every process" in err
    assert all(is_gone(pid) for pid in pids)


def test_processes_that_do_not_stop_are_killed_after_the_stop_grace_period():
    # As a process stuck in a collective or its input: the SIGTERM never gets handled.
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshkit.launch",
            "--stop-grace",
            "2",
            "--",
            sys.executable,
            "-c",
            IGNORE_SIGTERM,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = [int(line.split()[-1]) for line in first_lines(launcher)]
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)  # as `timeout` or a cluster's scancel sends it
    _, err = launcher.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert launcher.returncode == 128 + signal.SIGKILL
    assert err.strip().splitlines()[-1] == (
        "[launch] process(es) 0, 1 did not exit within 2 s of the stop request "
        "(--stop-grace); killing them (SIGKILL)"
    ), err  # its own SIGKILL is not blamed on the out-of-memory killer
    assert "out-of-memory" not in err
    assert all(is_gone(pid) for pid in pids)


def test_the_processes_die_with_a_killed_launcher():
    # Started in sessions of their own, they used to be re-parented to PID 1 and run on.
    launcher, ready = start_launcher(IGNORE_SIGTERM)
    pids = [int(line.split()[-1]) for line in ready]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while not all(is_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} outlived the launcher"
        time.sleep(0.05)


def test_the_coordination_service_listens_on_127_0_0_1_only(tmp_path: Path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from Linux's /proc/net")
    # Process 0 lists the sockets listening on the coordinator's port, IPv4 and IPv6.
    code = textwrap.dedent(f"""
        import os, meshkit
        meshkit.distributed.initialize()
        port = int(os.environ["MESHKIT_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
        if os.environ["MESHKIT_PROCESS_ID"] == "0":
            found = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for line in open(table).read().splitlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    address, hex_port = local.split(":")
                    if state == "0A" and int(hex_port, 16) == port:
                        found.append(address)
            open({str(tmp_path / "listening")!r}, "w").write(" ".join(found))
    """)
    result = run_launcher(code, "-d", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    listening = {proc_net_address(hex) for hex in (tmp_path / "listening").read_text().split()}
    assert listening == {ipaddress.ip_address("127.0.0.1")}  # it was [::], every interface


def proc_net_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order), decoded.

    An IPv4 address that an IPv6 socket listens on comes back as IPv4.
    """
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    address = ipaddress.ip_address(b"".join(words))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def test_timeout_kills_everything():
    result = run_launcher("import time; time.sleep(600)", "--timeout", "2")
    assert result.returncode == launch.TIMEOUT_EXIT_CODE
    assert "--timeout of 2 s passed" in result.stderr


def test_bad_command_lines_are_refused_with_the_fix():
    result = subprocess.run(
        [sys.executable, "-m", "meshkit.launch", "--processes", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "put it after '--'" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "meshkit.launch", "-n", "0", "--", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "--processes must be at least 1, got 0" in result.stderr
    assert launch.main(["--", "no-such-program-here"]) == 127


class ClosedTerminal(io.BytesIO):
    def write(self, data, /):
        raise OSError(5, "Input/output error")


def test_a_closed_terminal_does_not_stop_the_copying():
    # After a hangup, writes to the terminal fail; the child's pipe must still be drained
    # (or the child blocks on a full pipe while it saves), and nothing raises.
    prefixer = launch._Prefixer(0, 1, ClosedTerminal(), threading.Lock())
    read, write = os.pipe()

    def child() -> None:
        with os.fdopen(write, "wb") as out:
            out.write(b"line\n" * 100_000)  # more than a pipe holds: needs a reader

    writer = threading.Thread(target=child)
    writer.start()
    with os.fdopen(read, "rb") as stream:
        prefixer.copy(stream)
    writer.join(timeout=10)
    assert not writer.is_alive() and prefixer.out_closed


def test_progress_updates_keep_their_carriage_returns_behind_the_prefix():
    out = io.BytesIO()
    prefixer = launch._Prefixer(1, 1, out, threading.Lock())
    read, write = os.pipe()
    os.write(write, b"start\n\r 10%\r 20%\r\n half")
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        prefixer.copy(stream)
    assert out.getvalue() == b"[1] start\n[1]  10%\r[1]  20%\r\n[1]  half\n"
