"""Run a function or a script in several local JAX processes with fake CPU devices."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from meshkit._checks import check_int
from meshkit._runtime import Watchdog
from meshkit.distributed import backend_started
from meshkit.launch import free_port, process_environment


class ProcessFailedError(RuntimeError):
    """A child process failed or timed out; the message holds its log."""


def set_cpu_devices(count: int) -> None:
    """Makes JAX's CPU backend show ``count`` devices; call before any JAX use.

    Examples:
        >>> from meshkit.testing import set_cpu_devices
        >>> set_cpu_devices(8)  # doctest: +SKIP
    """
    check_int(count, name="The CPU device count", minimum=1)
    if backend_started():
        current = jax.local_device_count()
        if current == count:
            return
        raise RuntimeError(
            f"Cannot set {count} CPU devices: the JAX backend has already started with "
            f"{current}. Call set_cpu_devices before any other JAX use (in tests, from "
            "conftest.py), or set JAX_NUM_CPU_DEVICES in the environment."
        )
    jax.config.update("jax_num_cpu_devices", count)


def _target_of(function: Callable[..., Any]) -> tuple[str, str, str]:
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if module is None or "<" in qualname or module == "__main__":
        raise ValueError(
            f"run_processes needs a function defined at the top level of an importable "
            f"module, got {function!r} (module {module!r}). Move it to module level."
        )
    file = getattr(sys.modules[module], "__file__", None) or ""
    return module, file, qualname


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


class ProcessGroup:
    """Local processes joined by ``jax.distributed``, started by ``start_processes``.

    If the process that started them dies first (a test run killed by a timeout), a
    watchdog kills them, so none keeps running unsupervised.

    Attributes:
      processes: the ``subprocess.Popen`` of each process, in process order.
      log_dir: the folder holding ``process_<i>.log`` (and function results).
    """

    def __init__(
        self,
        processes: list[subprocess.Popen[bytes]],
        log_dir: Path,
        watchdog: Watchdog | None = None,
    ):
        self.processes = processes
        self.log_dir = log_dir
        self._watchdog = watchdog

    def log(self, process_id: int) -> str:
        """Everything process ``process_id`` printed so far."""
        path = self.log_dir / f"process_{process_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, timeout: float, *, check: bool = True) -> list[int]:
        """Waits for every process; returns their exit codes.

        Raises ``ProcessFailedError`` on the timeout (after killing them all) and, with
        ``check``, as soon as one process exits with a non-zero code.
        """
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = self._poll()
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if check and failed:
                    time.sleep(0.5)  # let the others report their own errors first
                    i = failed[0]
                    raise ProcessFailedError(
                        f"Process {i} of {len(codes)} exited with code {codes[i]}; its log "
                        f"({self.log_dir / f'process_{i}.log'}):\n{_tail(self.log(i))}"
                    )
                if all(code is not None for code in codes):
                    return [int(code) for code in codes if code is not None]
                if time.monotonic() > deadline:
                    running = [i for i, code in enumerate(codes) if code is None]
                    raise ProcessFailedError(
                        f"Processes {running} were still running after {timeout:.0f} s and were "
                        f"killed. Log of process {running[0]}:\n{_tail(self.log(running[0]))}"
                    )
                time.sleep(0.05)
        finally:
            self.kill()

    def _poll(self) -> list[int | None]:
        if self._watchdog is None:
            return [child.poll() for child in self.processes]
        return self._watchdog.poll(self.processes)

    def kill(self) -> None:
        """Kills every process that is still running (and its children)."""
        for child in self.processes:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        if self._watchdog is not None:
            self._watchdog.close()

    def results(self) -> list[Any]:
        """What a function target returned in each process (``None`` where nothing was)."""
        paths = [self.log_dir / f"result_{i}.pkl" for i in range(len(self.processes))]
        return [pickle.loads(p.read_bytes()) if p.exists() else None for p in paths]


def start_processes(
    target: Callable[..., Any] | Sequence[str],
    *args: Any,
    num_processes: int = 2,
    devices_per_process: int = 4,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike[str],
) -> ProcessGroup:
    """Starts ``target`` in ``num_processes`` local processes and returns at once.

    The same as ``run_processes`` without the waiting, for tests that must act on the
    processes while they run (send one of them a signal, kill them all).
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"num_processes and devices_per_process must be >= 1, got {num_processes} "
            f"and {devices_per_process}."
        )
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if callable(target):
        payload = logs / "target.pkl"
        payload.write_bytes(pickle.dumps((_target_of(target), args)))
        command = ["-m", "meshkit.testing._worker", str(payload)]
    else:
        command = list(target)
    address = f"127.0.0.1:{free_port()}"
    watchdog = Watchdog()
    processes = []
    for process_id in range(num_processes):
        child_env = process_environment(
            process_id,
            num_processes,
            devices_per_process,
            address,
            base={**os.environ, **(env or {})},
        )
        child_env["MESHKIT_RESULT"] = str(logs / f"result_{process_id}.pkl")
        with (logs / f"process_{process_id}.log").open("wb") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, *command],
                    env=child_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        watchdog.watch(processes[-1].pid)
    return ProcessGroup(processes, logs, watchdog)


def run_processes(
    target: Callable[..., Any] | Sequence[str],
    *args: Any,
    num_processes: int = 2,
    devices_per_process: int = 4,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> list[Any]:
    """Runs ``target`` in ``num_processes`` local processes joined by ``jax.distributed``.

    Each process gets ``devices_per_process`` fake CPU devices and the environment
    that ``meshkit.distributed.initialize()`` reads (coordinator on 127.0.0.1 at a
    free port, where the coordination service then listens, on that address only),
    so a pod run can be rehearsed on one machine.

    Args:
      target: a module-level function, called as ``target(*args)`` in every process
        after ``initialize()``; or a command line (``["script.py", "--flag"]``, run with
        this Python) that calls ``initialize()`` itself.
      *args: picklable arguments for a function target.
      num_processes: how many processes.
      devices_per_process: fake CPU devices in each.
      timeout: seconds before every process is killed and ``ProcessFailedError`` raised.
      env: extra environment variables for the children.
      log_dir: where to keep each process's log (``process_<i>.log``); a temporary
        folder by default.

    Returns:
      What the function returned in each process, in process order (``None`` for
      commands).

    Raises:
      ProcessFailedError: a process exited non-zero or the timeout passed; the message
        includes the failing process's output and traceback.

    Examples:
        >>> from meshkit.testing import run_processes
        >>> code = "import meshkit; meshkit.distributed.initialize()"
        >>> run_processes(["-c", code])  # doctest: +SKIP
        [None, None]
    """
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="meshkit-"))
        group = start_processes(
            target,
            *args,
            num_processes=num_processes,
            devices_per_process=devices_per_process,
            env=env,
            log_dir=log_dir,
        )
        group.wait(timeout)
        return group.results()
