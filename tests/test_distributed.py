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


@pytest.mark.parametrize(
    ("environ", "mode"),
    [
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"}, "slurm"),
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
