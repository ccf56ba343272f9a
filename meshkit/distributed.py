"""One ``initialize()`` for every way of launching a JAX program.

``meshkit.distributed.initialize()`` must run before any other JAX call. It decides
how the run was launched, in this order:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. meshkit's own environment variables ``MESHKIT_COORDINATOR_ADDRESS``,
   ``MESHKIT_NUM_PROCESSES`` and ``MESHKIT_PROCESS_ID`` (set by
   ``meshkit.testing.run_processes`` and by local launchers);
3. a cluster JAX detects by itself: a SLURM step with several tasks (``srun``), an
   Open MPI job, or a Cloud TPU VM; JAX's own auto-detection fills in the details;
4. otherwise a plain single process, where there is nothing to initialise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Literal

import jax

from meshkit._checks import check_int

__all__ = ["Launch", "backend_started", "detect_launch", "initialize"]

ENV_COORDINATOR = "MESHKIT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"

Mode = Literal["single", "explicit", "environment", "slurm", "mpi", "tpu"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was launched.

    Attributes:
      mode: ``single`` (one process, nothing to initialise), ``explicit`` (arguments),
        ``environment`` (meshkit's ``MESHKIT_*`` variables), or the cluster JAX
        auto-detects: ``slurm``, ``mpi`` or ``tpu``.
      coordinator_address: ``host:port`` of process 0, when known before JAX starts.
      num_processes: number of processes, when known before JAX starts.
      process_id: this process's id, when known before JAX starts.
    """

    mode: Mode
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} is not an integer.") from None


def _detect_cluster(environ: Mapping[str, str]) -> Mode | None:
    if "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" in environ:
        tasks = _int_env(environ, "SLURM_STEP_NUM_TASKS") or _int_env(environ, "SLURM_NTASKS") or 1
        if tasks > 1:
            return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and (_int_env(environ, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "mpi"
    hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in environ:
        return "tpu"
    return None


def detect_launch(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Launch:
    """Works out how this process was launched, without starting JAX.

    Examples:
        >>> detect_launch(environ={})
        Launch(mode='single', coordinator_address=None, num_processes=None, process_id=None)
        >>> detect_launch(environ={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0",
        ...                        "SLURM_STEP_NUM_TASKS": "4"}).mode
        'slurm'
    """
    environ = os.environ if environ is None else environ
    explicit = (coordinator_address, num_processes, process_id)
    if any(value is not None for value in explicit):
        if coordinator_address is None or num_processes is None or process_id is None:
            raise ValueError(
                "Pass all three of coordinator_address, num_processes and process_id, or none "
                f"(to auto-detect); got coordinator_address={coordinator_address!r}, "
                f"num_processes={num_processes!r}, process_id={process_id!r}."
            )
        return _checked(Launch("explicit", coordinator_address, num_processes, process_id))
    if ENV_COORDINATOR in environ:
        num = _int_env(environ, ENV_NUM_PROCESSES)
        pid = _int_env(environ, ENV_PROCESS_ID)
        if num is None or pid is None:
            raise ValueError(
                f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                f"set too; got {ENV_NUM_PROCESSES}={num!r}, {ENV_PROCESS_ID}={pid!r}."
            )
        return _checked(Launch("environment", environ[ENV_COORDINATOR], num, pid))
    cluster = _detect_cluster(environ)
    return Launch(cluster) if cluster else Launch("single")


def _checked(launch: Launch) -> Launch:
    address, num, pid = launch.coordinator_address, launch.num_processes, launch.process_id
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(
            f"coordinator_address must be 'host:port' of process 0, got {address!r} "
            "(e.g. '10.0.0.1:1234', or '127.0.0.1:1234' for processes on one machine)."
        )
    if not isinstance(num, int) or num < 1:
        raise ValueError(f"num_processes must be a positive int, got {num!r}.")
    if not isinstance(pid, int) or not 0 <= pid < num:
        raise ValueError(f"process_id must be an int in [0, {num}), got {pid!r}.")
    return launch


def backend_started() -> bool:
    """Whether a JAX backend has already started in this process.

    JAX offers no public query for this; ``jax_num_cpu_devices`` is validated
    against a started backend on every change, so a change (undone at once) answers
    the question without starting anything.
    """
    current = jax.config.jax_num_cpu_devices  # pyright: ignore[reportAttributeAccessIssue]
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    initialization_timeout: int = 300,
) -> Launch:
    """Initialises a distributed run however it was launched; call it before any JAX use.

    Args:
      coordinator_address: ``host:port`` of process 0, for an explicit launch.
      num_processes: number of processes, for an explicit launch.
      process_id: this process's id, for an explicit launch.
      local_device_ids: restricts this process to these local devices.
      cpu_devices: fake CPU devices per process (``jax_num_cpu_devices``), for
        rehearsing a multi-device run on CPU.
      initialization_timeout: seconds to wait for all processes to connect.

    Returns:
      The detected ``Launch``.

    Examples:
        >>> import meshkit
        >>> meshkit.distributed.initialize()  # doctest: +SKIP
        Launch(mode='single', coordinator_address=None, num_processes=None, process_id=None)
    """
    launch = detect_launch(coordinator_address, num_processes, process_id)
    if jax.distributed.is_initialized():
        return launch
    if backend_started():
        raise RuntimeError(
            "meshkit.distributed.initialize() was called after JAX had already started its "
            "backend (some JAX call such as jax.devices(), jax.numpy or a jit ran first). "
            "Call initialize() at the top of your program, before any other JAX use."
        )
    if cpu_devices is not None:
        check_int(cpu_devices, name="cpu_devices", minimum=1)
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    if launch.mode == "single":
        return launch
    jax.distributed.initialize(
        coordinator_address=launch.coordinator_address,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
    return launch
