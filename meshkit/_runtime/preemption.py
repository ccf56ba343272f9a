"""Preemption: a SIGTERM or a Ctrl-C noticed by every process at the same step."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

from meshkit._runtime import signals

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM or Ctrl-C after saving (EX_TEMPFAIL: "try again")."""

_CTRL_C_NOTE = (
    b"\n[meshkit] Ctrl-C: saving a checkpoint at the next step, then stopping (exit code 75). "
    b"Press Ctrl-C again to stop at once without saving.\n"
)


class PreemptionWatcher:
    """Tells every process, at the same step, that a SIGTERM or a Ctrl-C arrived.

    After ``jax.distributed.initialize`` JAX's preemption service notices a SIGTERM
    sent to any process (even one that arrived before ``fit`` started), and
    ``reached(step)`` returns ``True`` on all processes at the same step. A process
    without it (a plain single process) has no such service, so a SIGTERM handler
    records the signal instead.

    The first SIGINT (Ctrl-C) counts as a preemption too: with JAX's service the
    handler sends this process a SIGTERM, which the service sees; without it the
    handler records it. The handler then puts the previous SIGINT handler back, so a second
    Ctrl-C raises ``KeyboardInterrupt`` at once, without saving. A SIGINT handler of the
    program's own (or an ignored SIGINT) is left alone. Handlers are only installed
    from the main thread, the only one Python delivers signals to.
    """

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._previous_term: Any = None
        self._previous_int: Any = None
        processes = jax.process_count()
        self._synced = jax.distributed.is_initialized()
        self._watching = processes == 1 or self._synced
        if not self._watching:
            # Several processes without jax.distributed (e.g. a TPU pod whose launch was
            # not detected): a per-process flag could stop processes at different steps,
            # which hangs the others, so preemption is not watched at all.
            logging.getLogger("meshkit").warning(
                "%d processes run without jax.distributed.initialize(), so SIGTERM cannot be "
                "synchronised across them and preemption is not handled; call "
                "meshkit.distributed.initialize() with an explicit coordinator.",
                processes,
            )
            return
        if threading.current_thread() is not threading.main_thread():
            return
        if not self._synced:
            self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._signalled.set()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._restore_sigint()  # a second Ctrl-C interrupts at once
        os.write(2, _CTRL_C_NOTE)
        if self._synced:
            os.kill(os.getpid(), signal.SIGTERM)  # for JAX's preemption notifier
        else:
            self._signalled.set()

    def _restore_sigint(self) -> None:
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
            self._previous_int = None

    def reached(self, step: int, *, steps: int = 1) -> bool:
        """Whether to save and stop after ``step``; call it after every dispatch on every
        process, with the ``steps`` that dispatch ran (``step - steps + 1 .. step``).

        JAX's service picks the step after the furthest one any process has reported
        and answers ``True`` at exactly that step, so every step must be reported: a
        dispatch of several steps reports each, and the run stops at the end of the
        dispatch that holds the agreed step.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps!r}.")
        if self._synced:
            return any(
                multihost_utils.reached_preemption_sync_point(each)
                for each in range(step - steps + 1, step + 1)
            )
        if not self._watching:  # processes could stop at different steps: never stop
            return False
        return self._signalled.is_set() or signals.requested()

    def close(self) -> None:
        """Restores the SIGTERM and SIGINT handlers that were there before."""
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
        self._restore_sigint()
