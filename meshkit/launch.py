"""Rehearse a multi-host run on one machine: N local processes, fake CPU devices, one command.

    python -m meshkit.launch --processes 2 --devices-per-process 4 -- \\
        python -m recipes.data_parallel --steps 20

starts the command once per process with the environment that
``meshkit.distributed.initialize()`` reads (``MESHKIT_COORDINATOR_ADDRESS`` on
127.0.0.1 at a free port, ``MESHKIT_NUM_PROCESSES``, ``MESHKIT_PROCESS_ID``) and
``JAX_NUM_CPU_DEVICES`` / ``JAX_PLATFORMS=cpu``, so the processes form one JAX
runtime with ``processes × devices-per-process`` CPU devices, as the hosts of a pod
do. Each line a process prints comes out prefixed with its rank (``[1] ...``).

Signals: the first Ctrl-C (SIGINT), a SIGTERM and a hangup (SIGHUP: the terminal or
the ssh session closed) reach every process as SIGTERM, which a ``meshkit.train.fit``
run treats as a preemption: every process saves a checkpoint at the same step and
exits with code 75. A second Ctrl-C kills them, and so does the launcher when they
have not exited ``--stop-grace`` seconds (60) after the request, naming those still
running (a process stuck in a collective or in its input never reaches the save
point). If the launcher itself dies (SIGKILL,
a crash), a watchdog process kills its processes at once, so none is left running
unsupervised. When one process fails, the others would wait for it in their next
collective, so they are stopped after a grace period (``--grace``, 5 s: SIGTERM,
then SIGKILL 3 s later); when a signal ended it (SIGKILL from the out-of-memory
killer, say), it said nothing and no checkpoint can be saved without it, so they are
killed at once, and one line names the process and the signal. The exit code is 0
when every process succeeded, otherwise the first failing process's code (75 when all
of them were preempted, 124 on ``--timeout``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from meshkit._checks import check_int
from meshkit._runtime import Watchdog
from meshkit.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

TIMEOUT_EXIT_CODE = 124
DEFAULT_GRACE = 5.0
"""Seconds the other processes get after one fails, before they are stopped."""
KILL_AFTER_TERM = 3.0
"""Seconds between the SIGTERM that stops a process and the SIGKILL."""
DEFAULT_STOP_GRACE = 60.0
"""Seconds processes get to save and exit after a stop request (Ctrl-C, SIGTERM, SIGHUP)
before the launcher kills them; SLURM's and Kubernetes' defaults are 30 s, a save at
scale can take longer."""
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")  # a line, or a \r progress update


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_environment(
    process_id: int,
    num_processes: int,
    devices_per_process: int,
    coordinator: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of local process ``process_id`` in a rehearsal.

    ``base`` (default: this process's environment) plus the variables that
    ``meshkit.distributed.initialize()`` and JAX's CPU backend read, and the current
    directory on ``PYTHONPATH`` so ``python -m recipes.<name>`` works from a checkout.

    Examples:
        >>> env = process_environment(1, 2, 4, "127.0.0.1:1234", base={})
        >>> env["MESHKIT_PROCESS_ID"], env["MESHKIT_NUM_PROCESSES"], env["JAX_NUM_CPU_DEVICES"]
        ('1', '2', '4')
    """
    base = dict(os.environ if base is None else base)
    pythonpath = os.pathsep.join(filter(None, [str(Path.cwd()), base.get("PYTHONPATH")]))
    return {
        **base,
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
        "JAX_NUM_CPU_DEVICES": str(devices_per_process),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
    }


def _check_counts(processes: int, devices_per_process: int) -> None:
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process)):
        check_int(value, name=name, minimum=1)


class _Prefixer:
    """Copies a child's output to ``out``, each line (or ``\\r`` update) behind ``[rank] ``."""

    def __init__(self, rank: int, width: int, out: BinaryIO, lock: threading.Lock):
        self.prefix = f"[{rank:>{width}}] ".encode()
        self.out = out
        self.lock = lock
        self.out_closed = False  # e.g. the terminal went away: keep draining the child

    def copy(self, stream: BinaryIO) -> None:
        pending = b""
        while chunk := stream.read1(65536):  # pyright: ignore[reportAttributeAccessIssue]
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            if cut:
                self._write(pending[:cut])
                pending = pending[cut:]
        if pending:
            self._write(pending + b"\n")

    def _write(self, text: bytes) -> None:
        segments = _SEGMENT.findall(text)
        body = b"".join(self.prefix + segment for segment in segments if segment != b"\r")
        if self.out_closed:
            return
        with self.lock:
            try:
                self.out.write(body)
                self.out.flush()
            except (OSError, ValueError):
                self.out_closed = True


class LocalProcesses:
    """N local processes running one command; see the module docstring.

    Use ``launch`` for the whole lifecycle; this class is for callers that need the
    processes while they run.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        processes: int,
        devices_per_process: int,
        env: Mapping[str, str] | None = None,
        out: BinaryIO | None = None,
    ):
        _check_counts(processes, devices_per_process)
        if not command:
            raise ValueError(
                "No command to launch. Put it after '--', e.g. "
                "python -m meshkit.launch --processes 2 -- python -m recipes.data_parallel"
            )
        self.command = list(command)
        self._watchdog = Watchdog()  # kills the processes if the launcher dies first
        self.stop_requested: float | None = None  # when a stop was first requested
        coordinator = f"127.0.0.1:{free_port()}"
        sink: BinaryIO = out if out is not None else sys.stdout.buffer
        lock = threading.Lock()
        width = len(str(processes - 1))
        self.processes: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        for rank in range(processes):
            child_env = process_environment(rank, processes, devices_per_process, coordinator)
            child_env.update(env or {})
            try:
                child = subprocess.Popen(
                    self.command,
                    env=child_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # signals reach it only through the launcher
                )
            except FileNotFoundError:
                self.kill()
                raise FileNotFoundError(
                    f"Cannot run {self.command[0]!r}: no such program. Give the full "
                    f"command after '--', e.g. {sys.executable} -m recipes.data_parallel"
                ) from None
            self._watchdog.watch(child.pid)
            self.processes.append(child)
            assert child.stdout is not None
            thread = threading.Thread(
                target=_Prefixer(rank, width, sink, lock).copy, args=(child.stdout,), daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to every running process (and the processes it started)."""
        for child in self.processes:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signum)

    def kill(self) -> None:
        """Kills every running process and waits for them."""
        self.signal(signal.SIGKILL)
        for child in self.processes:
            child.wait()
        self._watchdog.close()

    def request_stop(self, signum: int) -> None:
        """Asks every process to save and stop (SIGTERM), starting the stop grace period."""
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
        self.signal(signum)

    def wait(
        self,
        *,
        timeout: float | None = None,
        grace: float = DEFAULT_GRACE,
        stop_grace: float = DEFAULT_STOP_GRACE,
    ) -> int:
        """Waits for every process and returns the launch's exit code.

        When a process fails, the others get ``grace`` seconds to finish (they may be
        failing too and printing why), then SIGTERM, then SIGKILL ``KILL_AFTER_TERM``
        seconds later. After a stop request (``request_stop``), processes still running
        ``stop_grace`` seconds later are killed, and named.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        first_failure: tuple[int, int] | None = None  # (rank, code)
        stop_at = None
        terminated = stop_killed = False
        while True:
            codes = self._watchdog.poll(self.processes)
            if first_failure is None:
                failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    first_failure = failed[0]
                    stop_at = time.monotonic() + grace
                    killed = first_failure[1] < 0 and self.stop_requested is None
                    if killed:  # by a signal the launcher did not forward: no word will come
                        self._note(_killed(*first_failure, codes))
                        self.signal(signal.SIGKILL)
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if (
                self.stop_requested is not None
                and not stop_killed
                and now > self.stop_requested + stop_grace
            ):
                running = [str(rank) for rank, code in enumerate(codes) if code is None]
                self._note(
                    f"process(es) {', '.join(running)} did not exit within {stop_grace:.0f} s "
                    "of the stop request (--stop-grace); killing them (SIGKILL)"
                )
                stop_killed = True  # the launcher's own SIGKILL: not one to explain later
                self.signal(signal.SIGKILL)
            if deadline is not None and now > deadline:
                self._note(f"--timeout of {timeout:.0f} s passed; killing every process")
                self.kill()
                self._join()
                return TIMEOUT_EXIT_CODE
            if stop_at is not None and now > stop_at:
                if not terminated:
                    assert first_failure is not None
                    running = [str(rank) for rank, code in enumerate(codes) if code is None]
                    self._note(
                        f"process {first_failure[0]} exited with code {first_failure[1]} and "
                        f"process(es) {', '.join(running)} still run {grace:.0f} s later "
                        "(--grace); stopping them (SIGTERM, then SIGKILL)"
                    )
                    self.signal(signal.SIGTERM)
                    terminated, stop_at = True, now + KILL_AFTER_TERM
                else:
                    self.kill()
            time.sleep(0.05)
        self._join()
        if first_failure is None:
            return 0
        return first_failure[1] if first_failure[1] > 0 else 128 - first_failure[1]

    def _join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=5)

    @staticmethod
    def _note(message: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # no terminal any more: carry on
            print(f"[launch] {message}", file=sys.stderr, flush=True)


def launch(
    command: Sequence[str],
    *,
    processes: int = 2,
    devices_per_process: int = 4,
    timeout: float | None = None,
    grace: float = DEFAULT_GRACE,
    stop_grace: float = DEFAULT_STOP_GRACE,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs ``command`` in ``processes`` local processes; returns the exit code.

    While they run, the first SIGINT (Ctrl-C), SIGTERM or SIGHUP reaches every process
    as SIGTERM (a ``fit`` run saves and exits with code 75) and a second SIGINT kills
    them (signal handlers are installed only when called from the main thread; an
    ignored SIGHUP, as under ``nohup``, stays ignored). Processes still running
    ``stop_grace`` seconds after such a stop request are killed. See the module
    docstring for the environment and the exit code.

    Examples:
        >>> import sys
        >>> launch([sys.executable, "-c", "print('hello')"], processes=2)  # doctest: +SKIP
        [0] hello
        [1] hello
        0
    """
    group = LocalProcesses(
        command, processes=processes, devices_per_process=devices_per_process, env=env
    )
    previous = {}
    if threading.current_thread() is threading.main_thread():
        forward = _Forwarder(group)
        watched = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            watched.append(signal.SIGHUP)
        previous = {sig: signal.signal(sig, forward) for sig in watched}
    try:
        return group.wait(timeout=timeout, grace=grace, stop_grace=stop_grace)
    finally:
        group.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _killed(rank: int, code: int, codes: Sequence[int | None]) -> str:
    """The launcher's line for a process that a signal ended (``code`` is minus its number)."""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    running = [str(other) for other, status in enumerate(codes) if status is None]
    why = (
        " (the out-of-memory killer and kill -9 send it; see dmesg or the scheduler's events)"
        if -code == signal.SIGKILL
        else ""
    )
    stopped = (
        f"; stopping process(es) {', '.join(running)} now (SIGKILL), which cannot go on "
        "without it. Rerun the same command to resume from the newest checkpoint"
        if running
        else ""
    )
    return f"process {rank} was ended by {name}{why}{stopped}"


class _Forwarder:
    """The launcher's signal handler: every stop request reaches the processes as SIGTERM."""

    def __init__(self, group: LocalProcesses):
        self.group = group
        self.interrupts = 0

    def __call__(self, signum: int, frame: object) -> None:
        del frame
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                LocalProcesses._note("second Ctrl-C: killing every process")
                self.group.signal(signal.SIGKILL)
                return
            LocalProcesses._note(
                "Ctrl-C: asking every process to save and stop (SIGTERM); "
                "press Ctrl-C again to kill them"
            )
        elif signum == signal.SIGHUP:
            LocalProcesses._note("hangup: asking every process to save and stop (SIGTERM)")
        self.group.request_stop(signal.SIGTERM)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m meshkit.launch",
        description=(
            "Run a command in N local processes joined by jax.distributed, each with its "
            "own fake CPU devices: a pod run rehearsed on one machine."
        ),
        epilog="example: python -m meshkit.launch --processes 2 --devices-per-process 4 "
        "-- python -m recipes.data_parallel --steps 20",
    )
    parser.add_argument("--processes", "-n", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--devices-per-process", "-d", type=int, default=4, help="fake CPU devices each (4)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="kill everything after this many seconds"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        help="seconds the others get after one process fails, before SIGTERM "
        f"(then SIGKILL {KILL_AFTER_TERM:.0f} s later; default {DEFAULT_GRACE:.0f})",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        help="seconds the processes get to save and exit after Ctrl-C, SIGTERM or SIGHUP, "
        f"before they are killed (default {DEFAULT_STOP_GRACE:.0f})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given; put it after '--'")
    for name in ("processes", "devices_per_process"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m meshkit.launch`` command line."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        return launch(
            args.command,
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            timeout=args.timeout,
            grace=args.grace,
            stop_grace=args.stop_grace,
        )
    except FileNotFoundError as error:
        print(f"[launch] {error}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
