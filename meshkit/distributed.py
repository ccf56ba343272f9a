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

With several processes it also makes failures end the job instead of hanging it: an
uncaught exception ends its process at once with its own exit code (see
``exit_on_uncaught_exception``), and when the coordinator is on this machine
(``127.0.0.1``, a rehearsal) the coordination service listens on that address only and
a process that stops sending heartbeats is declared dead after 10 s instead of JAX's
100 s, so its peers stop too.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Literal

import jax

from meshkit import _plugins
from meshkit._checks import check_int
from meshkit._runtime import abort as _runtime_abort
from meshkit._runtime import peers as _peer_failure
from meshkit._runtime import signals as _preemption_signals

__all__ = [
    "Launch",
    "backend_started",
    "detect_launch",
    "exit_on_uncaught_exception",
    "initialize",
    "is_loopback",
]

ENV_COORDINATOR = "MESHKIT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHKIT_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "MESHKIT_HEARTBEAT_TIMEOUT"
ENV_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"  # read by jax.distributed.initialize

LOCAL_HEARTBEAT_TIMEOUT = 10
"""Seconds without heartbeats before a process on this machine is declared dead."""
JAX_HEARTBEAT_TIMEOUT = 100
"""JAX's own default, kept for coordinators on other machines (networks have hiccups)."""
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

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
        ...     "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "1",
        ...     "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "node1"}).mode
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
    if cluster == "slurm":
        _check_slurm_step(environ)
    return Launch(cluster) if cluster else Launch("single")


SLURM_STEP_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
"""What JAX reads to join the tasks of a SLURM step (``srun`` sets them all)."""


def _check_slurm_step(environ: Mapping[str, str]) -> None:
    """Raises a one-line ``ValueError`` when SLURM variables announce several tasks but
    the ones JAX needs to find the others are missing (a shell inside an allocation, or
    a script run without ``srun``)."""
    missing = [name for name in SLURM_STEP_VARIABLES if name not in environ]
    if not missing:
        return
    said = ", ".join(
        f"{name}={environ[name]}"
        for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if name in environ
    )
    raise ValueError(
        f"SLURM variables say this process is one of several tasks ({said}), but "
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so it cannot "
        "find the others. Start every task with srun (as the docs' job scripts do), or run "
        "alone without the step's variables: env -u SLURM_STEP_ID python ..."
    )


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


def launcher_cpu_devices(requested: int, environ: Mapping[str, str] | None = None) -> int:
    """The fake CPU devices per process to use: the launcher's, when a launcher set them.

    ``meshkit.launch`` (and ``meshkit.testing.run_processes``) start every process
    with ``JAX_NUM_CPU_DEVICES`` beside ``MESHKIT_NUM_PROCESSES``; a script's own
    ``cpu_devices`` must not override that count in one process and not the others,
    so the launcher's wins, with a warning when they differ.

    Examples:
        >>> launcher_cpu_devices(8, environ={})
        8
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # "initialize(cpu_devices=8) is ignored: ..."
        ...     launcher_cpu_devices(8, {"MESHKIT_NUM_PROCESSES": "2", "JAX_NUM_CPU_DEVICES": "4"})
        4
    """
    environ = os.environ if environ is None else environ
    launched = environ.get("JAX_NUM_CPU_DEVICES")
    if ENV_NUM_PROCESSES not in environ or launched is None or int(launched) == requested:
        return requested
    warnings.warn(
        f"initialize(cpu_devices={requested}) is ignored: this process was started by "
        f"meshkit.launch with {launched} fake CPU devices per process "
        f"(JAX_NUM_CPU_DEVICES={launched}), the count every other process uses. Drop "
        f"cpu_devices=, or launch with --devices-per-process {requested}.",
        UserWarning,
        stacklevel=3,
    )
    return int(launched)


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this machine only (``127.x.x.x``, ``[::1]``, ``localhost``).

    Examples:
        >>> is_loopback("127.0.0.1:1234"), is_loopback("[::1]:1234"), is_loopback("10.0.0.1:1")
        (True, True, False)
    """
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _one_line(kind: type[BaseException], value: BaseException) -> str:
    text = " ".join(str(value).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{kind.__name__}: {text}" if text else kind.__name__


_LOST_PEER = (
    "Connection closed by peer",  # Gloo (CPU collectives)
    "Connection reset by peer",
    "remote process exited",  # NCCL
)


def _lost_peer(value: BaseException) -> bool:
    """Whether ``value`` is a collective that lost its connection to another process: the
    first sign, before the heartbeat timeout, of a process that died without a word."""
    return any(text in str(value) for text in _LOST_PEER)


def _process_id(given: int | None) -> int:
    if given is not None:
        return given
    from jax._src import distributed

    return int(distributed.global_state.process_id)


def _num_processes() -> int | None:
    from jax._src import distributed

    return distributed.global_state.num_processes


def exit_on_uncaught_exception(process_id: int | None = None) -> None:
    """Makes an uncaught exception end this process at once, with its own exit code.

    After ``jax.distributed.initialize`` a process that leaves through an exception
    first waits in ``jax.distributed``'s shutdown for every other process (up to 300 s),
    while they wait for it in their next collective: the whole job hangs. This hook
    first tells the other processes through JAX's key-value store (a watcher thread
    in each of them prints one line naming this failure and stops it within a
    second), then prints the traceback as before (through the previous
    ``sys.excepthook``) and one last line naming the error, flushes the standard
    streams and the ``logging`` handlers, and ends the process with ``os._exit``: code
    1, or 130 for ``KeyboardInterrupt``. Files the program left open and ``atexit``
    handlers are not flushed or run; ``meshkit.train.fit`` closes its own files on the
    way out.

    ``initialize`` installs it when there are several processes. Call it yourself only
    after a ``jax.distributed.initialize`` of your own.

    Args:
      process_id: this process's id, for the message (``None`` when not known).

    Examples:
        >>> import jax
        >>> from meshkit.distributed import exit_on_uncaught_exception
        >>> jax.distributed.initialize("10.0.0.1:1234", 2, 1)  # doctest: +SKIP
        >>> exit_on_uncaught_exception(process_id=1)  # doctest: +SKIP
    """
    previous = sys.excepthook
    peers = jax.distributed.is_initialized()
    me = _process_id(process_id) if peers else process_id
    name = "This process" if me is None else f"Process {me}"

    def hook(
        kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        code = INTERRUPTED_EXIT_CODE if issubclass(kind, KeyboardInterrupt) else 1

        line = _one_line(kind, value)
        lost = peers and _lost_peer(value)
        summary = f"a lost connection to another process ({line})" if lost else line

        def report(first: str | None) -> None:
            if first is None and lost and not _runtime_abort.reports_shown():
                print(
                    f"[meshkit] {name} stopped: a collective lost its connection to another "
                    f"process ({line}). A process that ends without a word "
                    "of its own was killed (the out-of-memory killer, kill -9) or lost its "
                    "host: see the other processes' logs and the scheduler's events. The "
                    f"traceback is left out ({_runtime_abort.ENV_SHOW}=1 shows it); exiting "
                    f"with code {code}.",
                    file=sys.stderr,
                )
                return
            if first is not None:
                print(
                    f"[meshkit] {name} failed too, with {line} "
                    f"(the first failure: {first}); exiting with code {code}.",
                    file=sys.stderr,
                )
                return
            previous(kind, value, traceback)
            print(
                f"[meshkit] {name} failed with {line}; exiting with code "
                f"{code}{'; the other processes stop too' if peers else ''}.",
                file=sys.stderr,
            )

        _peer_failure.fail_job(
            me or 0,
            code,
            summary,
            peers=peers,
            num_processes=_num_processes(),
            report=report,
        )

    sys.excepthook = hook
    if peers:
        _peer_failure.watch_peers(me)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: int | None = None,
    fail_fast: bool = True,
    preemption_signals: Sequence[str] | None = None,
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
      heartbeat_timeout: seconds without heartbeats after which a process is declared
        dead and every other process stops. By default ``MESHKIT_HEARTBEAT_TIMEOUT``,
        else 10 s when the coordinator address is a loopback one (every process is on
        this machine), otherwise JAX's 100 s.
      fail_fast: with several processes, end a process at once on an uncaught
        exception (``exit_on_uncaught_exception``) instead of letting it wait for the
        others in ``jax.distributed``'s shutdown, and tell the other processes, which
        stop within a second with one line naming it.
      preemption_signals: signals that mean "save a checkpoint and stop", like SIGTERM
        and Ctrl-C (``["USR1"]``; ``[]`` for none). By default
        ``MESHKIT_PREEMPTION_SIGNALS`` (comma-separated), else SIGUSR1 inside a SLURM
        job (the signal of ``#SBATCH --signal=USR1@120``) and none elsewhere.

    Returns:
      The detected ``Launch``.

    On a machine whose only accelerator plugins have no chips here (libtpu without
    TPUs, JAX's CUDA plugin without GPUs: installed to plan for them), JAX starts on
    the CPU without asking them, which would each fail and say so at length; a
    choice of ``JAX_PLATFORMS`` or ``jax_platforms`` is kept.

    A loopback coordinator address also binds the coordination service to that address
    (JAX binds it to every interface by default) unless ``JAX_COORDINATOR_BIND_ADDRESS``
    says otherwise.

    With several processes, this process's standard error then passes through a small
    filter process that turns the fatal C++ report JAX's runtime prints when another
    process is lost into one line naming it (``MESHKIT_RUNTIME_REPORTS=1`` keeps the
    report as it is); everything else is copied through unchanged.

    Examples:
        >>> import meshkit
        >>> meshkit.distributed.initialize()  # doctest: +SKIP
        Launch(mode='single', coordinator_address=None, num_processes=None, process_id=None)
    """
    launch = detect_launch(coordinator_address, num_processes, process_id)
    if heartbeat_timeout is not None:
        check_int(heartbeat_timeout, name="heartbeat_timeout", minimum=1, unit="s")
    if jax.distributed.is_initialized():
        return launch
    if backend_started():
        raise RuntimeError(
            "meshkit.distributed.initialize() was called after JAX had already started its "
            "backend (some JAX call such as jax.devices(), jax.numpy or a jit ran first). "
            "Call initialize() at the top of your program, before any other JAX use."
        )
    _plugins.cpu_only_without_accelerators()
    if cpu_devices is not None:
        check_int(cpu_devices, name="cpu_devices", minimum=1)
        jax.config.update("jax_num_cpu_devices", launcher_cpu_devices(cpu_devices))
    environ = os.environ
    if preemption_signals is not None:
        environ = {
            **os.environ,
            _preemption_signals.ENV_PREEMPTION_SIGNALS: ",".join(preemption_signals),
        }
    _preemption_signals.watch(_preemption_signals.preemption_signals(environ))
    if launch.mode == "single":
        return launch
    address = launch.coordinator_address
    local = address is not None and is_loopback(address)
    if heartbeat_timeout is None and os.environ.get(ENV_HEARTBEAT_TIMEOUT):
        heartbeat_timeout = _int_env(os.environ, ENV_HEARTBEAT_TIMEOUT)
        check_int(heartbeat_timeout, name=ENV_HEARTBEAT_TIMEOUT, minimum=1, unit="s")
    if heartbeat_timeout is None:
        heartbeat_timeout = LOCAL_HEARTBEAT_TIMEOUT if local else JAX_HEARTBEAT_TIMEOUT
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
        coordinator_bind_address=address if local and ENV_BIND_ADDRESS not in os.environ else None,
    )
    _preemption_signals.forward_to_jax()
    _runtime_abort.start(jax.process_index())
    if fail_fast and (launch.num_processes is None or launch.num_processes > 1):
        exit_on_uncaught_exception(launch.process_id)
    return launch
