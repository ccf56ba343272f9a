"""The first failure of a multi-process job, told to every process through JAX's key-value store.

Without this, a process whose peer failed learns of it only from the runtime: at once
when the peer hosted the coordination service (process 0), otherwise after the
heartbeat timeout (100 s on a cluster), and then through a C++ abort with a stack
trace, or a collective's ``Connection closed by peer``, printed after the real error.

With it, a failing process publishes one line (who failed, with what) under
``FAILURE_KEY`` before anything else. A watcher thread in every other process waits on
that key; when it appears the process prints one line naming the failed process and
exits with the same code, within a fraction of a second. The failing process waits
(at most ``ACK_TIMEOUT`` seconds) until its peers have said so, then prints its own
traceback: the real error is the last thing in the job's output, and the failing
process exits first (the others wait for its word that the error is printed). A process
that fails after another one did prints its own error in one line, not a second
traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

FAILURE_KEY = "meshkit/failure"
STOPPED_PREFIX = "meshkit/stopped/"
REPORTED_KEY = "meshkit/failure-reported"
ACK_TIMEOUT = 3.0
"""Seconds a failing process waits for its peers to stop before printing its error."""
SETTLE = 0.5
"""Seconds a failing process waits after its peers stopped, before printing its error: a
launcher copies each process's output in a thread of its own (``meshkit.launch``,
``srun``), and on a busy machine the peers' last lines, written first, can reach the
job's output after a line written later."""
EXIT_AFTER = 1.0
"""Seconds a stopping process waits after the failing one said its error is printed."""
POLL_MS = 200
"""One blocking key-value read at a time (the GIL is released while it waits); the
watcher is joined before the interpreter exits, so a normal exit waits at most this."""

_closing = threading.Event()


def _client() -> Any:
    """JAX's coordination client, or ``None`` (not initialised, or not where JAX kept it)."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


def flush_streams() -> None:
    """Flushes stdout and stderr; a closed or missing stream is left alone."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


def silence() -> None:
    """Sends whatever this process still prints to ``/dev/null``: after its last word, a
    process that stops must not bury the real error under the runtime's reactions (a
    fatal log and C++ stack trace when the coordination service goes away, a note on
    the SIGTERM a launcher sends)."""
    flush_streams()
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)


def announce(process_id: int, code: int, summary: str, num_processes: int | None) -> str | None:
    """Publishes this process's failure; returns the earlier failure's line if there was one.

    When this is the first failure, waits until every peer has stopped (or
    ``ACK_TIMEOUT`` passes) so that the caller's error is printed after theirs.
    """
    client = _client()
    if client is None:
        return None
    _closing.set()  # this process's own watcher has nothing more to do
    try:
        client.key_value_set(FAILURE_KEY, f"{process_id}\t{code}\t{summary}")
    except Exception:  # the key exists: a peer failed first; or the service is gone
        with contextlib.suppress(Exception):
            return client.key_value_try_get(FAILURE_KEY).split("\t", 2)[2]
        return None
    peers = (num_processes or 1) - 1
    deadline = time.monotonic() + ACK_TIMEOUT
    while peers > 0 and time.monotonic() < deadline:
        try:
            if len(client.key_value_dir_get(STOPPED_PREFIX)) >= peers:
                time.sleep(SETTLE)
                break
        except Exception:
            break
        time.sleep(0.05)
    return None


def fail_job(
    process_id: int,
    code: int,
    summary: str,
    *,
    peers: bool,
    num_processes: int | None,
    report: Callable[[str | None], None],
) -> NoReturn:
    """Ends this process as the job's failure.

    With ``peers`` (a multi-process job of ``num_processes``) it tells the other
    processes first. Then ``report`` prints; it receives the earlier failure's line, or
    ``None`` when this failure is the first. Last, the streams and ``logging`` handlers
    are flushed, the peers hear that the error is printed, and the process exits with
    ``code`` without the interpreter's shutdown (whose collectives would wait for the
    stopped peers).
    """
    first = announce(process_id, code, summary, num_processes) if peers else None
    try:
        report(first)
    finally:
        flush_streams()
        logging.shutdown()
        if peers and first is None:
            reported()
        elif peers:  # another process failed first: it prints last, and this one waits
            _wait_for_the_first_failure(process_id)
        os._exit(code)


def _stop_for(process_id: int, value: str) -> None:
    failed, code, summary = value.split("\t", 2)
    print(
        f"[meshkit] Process {process_id} stopping: process {failed} failed with {summary} "
        "(its traceback follows).",
        file=sys.stderr,
    )
    _wait_for_the_first_failure(process_id)
    os._exit(int(code))


def _wait_for_the_first_failure(process_id: int) -> None:
    """Goes quiet, tells the first failing process that this one stopped, and waits until
    it says its error is printed.

    Exit after the failing process: it prints while the coordination service (process
    0) is up, and a launcher that stops the job at the first bad exit (srun
    --kill-on-bad-exit) does not cut its traceback short. A process that fails after
    another one did waits the same way, rather than ending the job under the first.
    """
    silence()
    client = _client()
    with contextlib.suppress(Exception):
        client.key_value_set(f"{STOPPED_PREFIX}{process_id}", "1")
    with contextlib.suppress(Exception):
        client.blocking_key_value_get(REPORTED_KEY, int((ACK_TIMEOUT + 10) * 1000))
    time.sleep(EXIT_AFTER)  # the failing process exits first, before the service can vanish


def reported() -> None:
    """Says that the first failure's error is printed (process 0 may now exit)."""
    client = _client()
    if client is not None:
        silence()
        with contextlib.suppress(Exception):
            client.key_value_set(REPORTED_KEY, "1")


def _watch(client: Any, process_id: int) -> None:
    while not _closing.is_set():
        try:
            value = client.blocking_key_value_get(FAILURE_KEY, POLL_MS)
        except Exception:  # nothing yet (a timeout), or the runtime is shutting down
            if not _closing.is_set():
                time.sleep(0.05)
            continue
        if _closing.is_set():
            return
        if int(value.split("\t", 1)[0]) != process_id:
            _stop_for(process_id, value)
        return


def watch_peers(process_id: int | None) -> None:
    """Starts the watcher thread of this process (after ``jax.distributed.initialize``)."""
    client = _client()
    if client is None or process_id is None:
        return
    watcher = threading.Thread(
        target=_watch, args=(client, process_id), name="meshkit-peer-failure", daemon=True
    )
    watcher.start()

    def close() -> None:  # a thread left inside a C++ call when Python exits aborts it
        _closing.set()
        watcher.join(timeout=5 * POLL_MS / 1000)

    atexit.register(close)  # runs before JAX's own shutdown, which registered earlier
