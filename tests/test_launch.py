"""python -m meshkit.launch: environment, rank prefixes, failures, signals, timeouts."""

from __future__ import annotations

import io
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

pytestmark = pytest.mark.multiprocess


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
        meshkit.distributed.initialize()
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


def test_a_failing_process_stops_the_others_and_sets_the_exit_code():
    code = textwrap.dedent("""
        import os, sys, time
        if os.environ["MESHKIT_PROCESS_ID"] == "1":
            sys.exit(3)
        time.sleep(600)  # stands in for a process waiting on its peer forever
    """)
    start = time.monotonic()
    result = run_launcher(code, "--grace", "1")
    assert result.returncode == 3
    assert time.monotonic() - start < 60
    assert "process 1 exited with code 3" in result.stderr


def test_sigterm_reaches_every_process_and_their_exit_code_comes_back():
    code = textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("saving", flush=True), sys.exit(75)))
        print("ready", flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshkit.launch", "--", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    ready = [launcher.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["[0] ready\n", "[1] ready\n"]
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 75
    assert sorted(out.splitlines()) == ["[0] saving", "[1] saving"]


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


def test_progress_updates_keep_their_carriage_returns_behind_the_prefix():
    out = io.BytesIO()
    prefixer = launch._Prefixer(1, 1, out, threading.Lock())
    read, write = os.pipe()
    os.write(write, b"start\n\r 10%\r 20%\r\n half")
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        prefixer.copy(stream)
    assert out.getvalue() == b"[1] start\n[1]  10%\r[1]  20%\r\n[1]  half\n"
