"""A run that stops making progress ends, naming where it stopped, instead of hanging.

A process can stall without crashing: its input blocks (a dead file server, a
deadlocked transform), or a collective waits for a peer that never arrives. The
heartbeats of ``jax.distributed`` see a live process and the job waits forever.
``StallWatch`` watches progress instead: a thread notes when the training loop last
moved from waiting for input to waiting for the devices or back; when one wait lasts
longer than the stall timeout, the run is declared stalled. The process prints the
main thread's stack (where it waits) and one line naming the step and the wait, tells
its peers as a failing process does (they stop within a second, naming it), and exits
with code 1.

The first step (which compiles), evaluations and checkpoint saves are not watched, so
long compiles and long evaluations never count as a stall. A process that waits for
the devices reports ``DEVICE_GRACE`` seconds later than one that waits for its input,
so that when one process's input stalls and the others wait for it in a collective,
the stalled process is the one named.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import jax

from meshkit._runtime import peers as peer_failure

ENV_STALL_TIMEOUT = "MESHKIT_STALL_TIMEOUT"
DEFAULT_STALL_TIMEOUT = 1800.0
"""Seconds one wait of the training loop may last: far beyond a slow step at scale."""
DEVICE_GRACE = 15.0
STALLED_EXIT_CODE = 1

_WAITS = {
    "input": "waiting for its next input batch",
    "devices": "waiting for the devices (a step or a collective whose peers do not arrive)",
}


def stall_timeout(given: float | None) -> float:
    """``given``, else ``MESHKIT_STALL_TIMEOUT``, else ``DEFAULT_STALL_TIMEOUT`` seconds."""
    if given is not None:
        return float(given)
    text = os.environ.get(ENV_STALL_TIMEOUT)
    if not text:
        return DEFAULT_STALL_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{ENV_STALL_TIMEOUT}={text!r} is not a number of seconds; expected e.g. 600"
        ) from None
    if value <= 0:
        raise ValueError(f"{ENV_STALL_TIMEOUT}={text!r} must be > 0 seconds")
    return value


class StallWatch:
    """Declares the run stalled when one wait of the loop outlasts ``timeout`` seconds."""

    def __init__(self, timeout: float | None = None):
        self.timeout = stall_timeout(timeout)
        self._wait: str | None = None  # None: not watched (first step, boundaries)
        self._step = 0
        self._since = time.monotonic()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident

    def enter(self, wait: str, step: int) -> None:
        """The loop now waits for ``"input"`` or ``"devices"`` at ``step``."""
        self._since = time.monotonic()
        self._wait, self._step = wait, step
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="meshkit-stall", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """Stops watching until the next ``enter`` (the first step, a boundary)."""
        self._wait = None

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        poll = min(5.0, max(self.timeout / 10, 0.05))
        while not self._closed.wait(poll):
            wait, since = self._wait, self._since
            if wait is None:
                continue
            limit = self.timeout + (DEVICE_GRACE if wait == "devices" else 0.0)
            waited = time.monotonic() - since
            if waited > limit:
                self._report(wait, self._step, waited)

    def _report(self, wait: str, step: int, waited: float) -> None:
        peers = jax.distributed.is_initialized() and jax.process_count() > 1
        process = jax.process_index()
        summary = f"StallError: no progress for {waited:.0f} s at step {step}, {_WAITS[wait]}"

        def report(first: str | None) -> None:
            if first is not None:
                return  # a peer failed first; it prints the job's error
            frame = sys._current_frames().get(self._main or -1)  # pyright: ignore[reportPrivateUsage]
            if frame is not None:
                print("Where the main thread waits (most recent call last):", file=sys.stderr)
                print("".join(traceback.format_stack(frame)), end="", file=sys.stderr)
            print(
                f"[meshkit] Process {process} stalled: no progress for {waited:.0f} s at step "
                f"{step}, {_WAITS[wait]}. The limit is Dispatch(stall_timeout=) or "
                f"{ENV_STALL_TIMEOUT} ({self.timeout:g} s); exiting with code "
                f"{STALLED_EXIT_CODE}{'; the other processes stop too' if peers else ''}.",
                file=sys.stderr,
            )

        peer_failure.fail_job(
            process,
            STALLED_EXIT_CODE,
            summary,
            peers=peers,
            num_processes=jax.process_count(),
            report=report,
        )
