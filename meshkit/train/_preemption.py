"""Preemption: a SIGTERM noticed by every process at the same step."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM after saving (EX_TEMPFAIL: "try again")."""


class PreemptionWatcher:
    """Tells every process, at the same step, that a SIGTERM arrived.

    With several processes JAX's preemption service (started by
    ``jax.distributed.initialize``) notices a SIGTERM sent to any one of them, and
    ``reached(step)`` returns ``True`` on all processes at the same step. A single
    process has no such service, so a SIGTERM handler records the signal instead.
    """

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._previous: Any = None
        processes = jax.process_count()
        self._multi = processes > 1 and jax.distributed.is_initialized()
        if processes > 1 and not self._multi:
            # Several processes without jax.distributed (e.g. a TPU pod whose launch was
            # not detected): a per-process flag could stop processes at different steps,
            # which hangs the others, so preemption is not watched at all.
            logging.getLogger("meshkit").warning(
                "%d processes run without jax.distributed.initialize(), so SIGTERM cannot be "
                "synchronised across them and preemption is not handled; call "
                "meshkit.distributed.initialize() with an explicit coordinator.",
                processes,
            )
        elif processes == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._signalled.set()

    def reached(self, step: int) -> bool:
        """Whether to save and stop after ``step``; call it at every step on every process."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._signalled.is_set()  # never set with several unsynchronised processes

    def close(self) -> None:
        """Restores the previous SIGTERM handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
