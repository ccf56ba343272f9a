"""meshkit.distributed: launch detection and initialize()."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

import meshkit
from meshkit.distributed import Launch, detect_launch


def test_detect_single_explicit_and_environment():
    assert detect_launch(environ={}) == Launch("single")
    assert detect_launch("10.0.0.1:1234", 4, 3, environ={}) == Launch(
        "explicit", "10.0.0.1:1234", 4, 3
    )
    env = {
        "MESHKIT_COORDINATOR_ADDRESS": "127.0.0.1:99",
        "MESHKIT_NUM_PROCESSES": "2",
        "MESHKIT_PROCESS_ID": "1",
    }
    assert detect_launch(environ=env) == Launch("environment", "127.0.0.1:99", 2, 1)


SRUN = {
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
}  # what srun sets for each task


@pytest.mark.parametrize(
    ("environ", "mode"),
    [
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "8"}, "slurm"),
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}, "single"),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}, "single"),  # salloc shell, not srun
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "mpi"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "tpu"),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, "single"),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "c:1"}, "tpu"),
    ],
)
def test_detect_clusters(environ, mode):
    assert detect_launch(environ=environ).mode == mode


def test_detect_rejects_partial_or_bad_arguments():
    with pytest.raises(ValueError, match="Pass all three"):
        detect_launch("127.0.0.1:1", environ={})
    with pytest.raises(ValueError, match="'host:port'"):
        detect_launch("localhost", 2, 0, environ={})
    with pytest.raises(ValueError, match=r"in \[0, 2\), got 2"):
        detect_launch("h:1", 2, 2, environ={})
    with pytest.raises(ValueError, match="MESHKIT_PROCESS_ID"):
        detect_launch(environ={"MESHKIT_COORDINATOR_ADDRESS": "h:1", "MESHKIT_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="MESHKIT_NUM_PROCESSES='two' is not an integer"):
        detect_launch(
            environ={
                "MESHKIT_COORDINATOR_ADDRESS": "h:1",
                "MESHKIT_NUM_PROCESSES": "two",
                "MESHKIT_PROCESS_ID": "0",
            }
        )


def test_initialize_after_backend_started_is_refused():
    jax.devices()  # starts the backend, as any JAX call would
    with pytest.raises(RuntimeError, match="before any other JAX use"):
        meshkit.distributed.initialize()


def test_initialize_in_a_fresh_process_sets_cpu_devices():
    code = (
        "import meshkit, jax; "
        "launch = meshkit.distributed.initialize(cpu_devices=3); "
        "print(launch.mode, jax.device_count())"
    )
    env = {"PATH": "", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["single", "3"]


@pytest.mark.parametrize(
    ("address", "env", "bind", "heartbeat"),
    [
        ("127.0.0.1:1234", {}, "127.0.0.1:1234", 10),  # a rehearsal: this machine only
        ("localhost:1234", {}, "localhost:1234", 10),
        ("10.0.0.1:1234", {}, None, 100),  # another host: JAX's defaults
        ("127.0.0.1:1234", {"JAX_COORDINATOR_BIND_ADDRESS": "[::]:1234"}, None, 10),
    ],
)
def test_initialize_binds_a_loopback_coordinator_to_it_and_shortens_the_heartbeat(
    monkeypatch, address, env, bind, heartbeat
):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(meshkit.distributed, "backend_started", lambda: False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    meshkit.distributed.initialize(address, 2, 1)
    assert calls[0]["coordinator_bind_address"] == bind
    assert calls[0]["heartbeat_timeout_seconds"] == heartbeat
    assert sys.excepthook is not sys.__excepthook__  # several processes: fail fast
    meshkit.distributed.initialize(address, 2, 1, heartbeat_timeout=30, fail_fast=False)
    assert calls[1]["heartbeat_timeout_seconds"] == 30
    with pytest.raises(ValueError, match="heartbeat_timeout must be an int >= 1 s, got 0"):
        meshkit.distributed.initialize(address, 2, 1, heartbeat_timeout=0)


def test_one_process_keeps_the_default_excepthook(monkeypatch):
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(meshkit.distributed, "backend_started", lambda: False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    meshkit.distributed.initialize("127.0.0.1:1234", 1, 0)
    assert sys.excepthook is sys.__excepthook__


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("raised", "code"), [("ValueError('bad row 7')", 1), ("KeyboardInterrupt()", 130)]
)
def test_an_uncaught_exception_exits_at_once_with_its_code(raised, code):
    # atexit stands in for jax.distributed's shutdown, which waits for every process.
    program = (
        "import atexit, sys, meshkit.distributed as d\n"
        "d.exit_on_uncaught_exception(process_id=3)\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "print('unflushed', end='')\n"
        f"raise {raised}\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False
    )
    assert out.returncode == code
    assert out.stdout == "unflushed"
    kind = raised.split("(")[0]
    assert f"\n{kind}" in out.stderr  # the traceback, printed by the previous hook
    message = " bad row 7" if code == 1 else ""
    assert out.stderr.rstrip().endswith(
        f"[meshkit] Process 3 failed with {kind}:{message}; exiting with code {code}."
        if message
        else f"[meshkit] Process 3 failed with {kind}; exiting with code {code}."
    )


def test_slurm_variables_without_the_step_jax_needs_say_how_to_run_alone():
    environ = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    with pytest.raises(ValueError) as error:
        detect_launch(environ=environ)
    message = str(error.value)
    assert "(SLURM_JOB_ID=77, SLURM_STEP_ID=0, SLURM_NTASKS=2)" in message
    assert "SLURM_STEP_NODELIST, SLURM_LOCALID are not set" in message
    assert "srun" in message and "env -u SLURM_STEP_ID" in message and "\n" not in message
