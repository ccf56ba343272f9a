"""Orbax's errors, read and quieted: the root cause of a chain, one line per logged error.

A failed Orbax save or restore is reported many times over: by several of Orbax's
threads with full tracebacks, by asyncio for each read it abandoned, and by
TensorStore's threads finishing reads after Orbax's event loop closed. The
``Checkpointer`` raises one error that names the damage and chains the first
failure; the functions here keep the rest to a line each, or drop them.
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from typing import Any


def chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from, outermost first."""
    links = [error]
    while (cause := links[-1].__cause__ or links[-1].__context__) and cause not in links:
        links.append(cause)
    return links


def root_cause(error: BaseException, limit: int = 300) -> str:
    """The innermost exception's first line (Orbax wraps TensorStore's own message).

    TensorStore's JSON spec, appended to its messages, is left out.
    """
    root = chain(error)[-1]
    line = (str(root).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    return f"{type(root).__name__}: {line if len(line) <= limit else line[: limit - 3] + '...'}"


def os_error(error: BaseException) -> OSError | None:
    """The first ``OSError`` in ``error``'s chain (``ENOSPC`` for a full disk), if any."""
    return next((e for e in chain(error) if isinstance(e, OSError)), None)


class _OneLineOrbaxErrors(logging.Filter):
    """Keeps Orbax's error records to their first line.

    A failed background save is logged by several Orbax threads, each with the full
    traceback; the ``CheckpointSaveError`` raised for it carries that traceback once.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in record.pathname:
            record.exc_info = record.exc_text = None
        return True


_ONE_LINE = _OneLineOrbaxErrors()


def one_line_orbax_errors() -> None:
    """Keeps Orbax's logged errors to one line each from now on (idempotent)."""
    logging.getLogger("absl").addFilter(_ONE_LINE)  # a no-op when already there


def collect_abandoned_reads() -> None:
    """Collects the reads a failed restore abandoned, so that they are reported (silenced) now."""
    gc.collect()


def _raised_in_orbax(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it was raised from) passed through Orbax's code."""
    for link in chain(error) if error is not None else []:
        frames = traceback.extract_tb(link.__traceback__)
        if any("orbax" in frame.filename for frame in frames):
            return True
    return False


def _abandoned_read(exc_value: BaseException | None) -> bool:
    """Whether an unretrieved exception comes from a read that a failed restore abandoned.

    Either it was raised in Orbax, or it is TensorStore finishing a read after Orbax
    closed the event loop that was waiting for it.
    """
    if exc_value is None:
        return False
    frames = traceback.extract_tb(exc_value.__traceback__)
    closed_loop = isinstance(exc_value, RuntimeError) and any(
        frame.name == "call_soon_threadsafe" for frame in frames
    )
    return closed_loop or _raised_in_orbax(exc_value)


class _DropAbandonedReads(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for abandoned reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _abandoned_read(record.exc_info[1]))


def silence_abandoned_reads() -> None:
    """Silences the reports of the reads that a failed Orbax restore abandons.

    When one array read fails, Orbax stops waiting for the others, and Python,
    asyncio and TensorStore's threads report each one as it ends or is collected,
    with TensorStore's full spec: dozens of lines per array, some of them after the
    restore has returned. The ``CheckpointDamagedError`` raised instead names the
    damage and chains the first failure. Installed at the first restore, for the rest
    of the process; every other report goes to the previous hook.
    """
    previous = sys.unraisablehook
    if not getattr(previous, "drops_abandoned_reads", False):

        def hook(unraisable: Any) -> None:
            if not _abandoned_read(unraisable.exc_value):
                previous(unraisable)

        hook.drops_abandoned_reads = True  # pyright: ignore[reportFunctionMemberAccess]
        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_DropAbandonedReads())
