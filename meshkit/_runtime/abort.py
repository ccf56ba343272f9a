"""Keeps the C++ report of JAX's distributed runtime out of a job's output: one line instead.

When a process of a multi-process job dies without a word (SIGKILL from the
out-of-memory killer, a lost host), the others learn of it from JAX's runtime, which
ends them through a fatal C++ log: a few error lines, ``Terminating process because the
JAX distributed service detected fatal errors``, and a C++ stack trace, 20 to 30 lines
per process that bury the one fact that matters (which process was lost).

``meshkit.distributed.initialize`` routes each process's standard error through this
file, run as a small process of its own (``python -I -S abort.py <process
id>``: the standard library only, so it starts in milliseconds). It copies everything
through at once, except a C++ log line (``E1127 11:32:11.217444 8823 client.h:80] ...``),
which it holds with what follows until the output has been quiet for ``QUIET`` seconds
(at most ``HOLD_AT_MOST``) or ends: if that block holds the runtime's fatal message,
it becomes one line naming the lost process, and the rest of its stack trace, which a
busy machine may print after a pause, is dropped too; any other block is copied
through unchanged, a moment later.
``MESHKIT_RUNTIME_REPORTS=1`` turns this off. The filter ignores the stop signals a
launcher sends to the job, so that it outlives its process and copies its last words.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import time
from collections.abc import Callable

FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
QUIET = 0.2
"""Seconds without output after which a held C++ log block is judged and written."""
HOLD_AT_MOST = 2.0
"""Seconds a block is held even while the process keeps writing (a progress bar)."""
ENV_SHOW = "MESHKIT_RUNTIME_REPORTS"
_CPP_LOG = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.\-/]+\.(?:cc|h):\d+\] ")
_MAYBE_CPP_LOG = re.compile(rb"[IWEF](?:\d|$)")  # an unfinished line that may become one
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")
_TRACE = re.compile(rb"\*\*\* Check failure stack trace|\s+@ ")
"""A line of the stack trace that follows the runtime's fatal message."""


def gist(report: bytes) -> str:
    """What the runtime's report says happened, in a few words."""
    lost = re.search(rb"stopped sending heartbeats\):\s*([\d,\s]+)", report)
    if lost:
        ids = ", ".join(re.findall(r"\d+", lost.group(1).decode()))
        many = "," in ids
        return f"process{'es' if many else ''} {ids} stopped sending heartbeats"
    if any(text in report for text in (b"Socket closed", b"Connection reset", b"UNAVAILABLE")):
        return "process 0, which runs the job's coordination service, stopped answering"
    return "another process failed"


def summary(process_id: str, report: bytes) -> bytes:
    """The one line that replaces the runtime's fatal report."""
    lines = len(report.splitlines())
    return (
        f"[meshkit] Process {process_id} stopped: JAX's distributed runtime ended it because "
        f"{gist(report)}. A process that ends without a word of its own was killed (the "
        "out-of-memory killer, kill -9) or lost its host: see its log and the scheduler's "
        f"events. The runtime's {lines}-line C++ report is left out ({ENV_SHOW}=1 shows it).\n"
    ).encode()


class AbortFilter:
    """The filter's logic, apart from its input and clock: ``feed`` what the process
    wrote, call ``quiet`` when nothing came for ``QUIET`` seconds, ``close`` at the end."""

    def __init__(self, process_id: str, write: Callable[[bytes], None]):
        self.process_id = process_id
        self.write = write
        self.held = b""  # a C++ log block, and whatever followed it
        self.pending = b""  # the unfinished start of a line that may be a C++ log line
        self.summarized = False  # the fatal report was said: what is left of its trace goes

    @property
    def holding(self) -> bool:
        return bool(self.held or self.pending)

    def feed(self, data: bytes) -> None:
        if self.held:
            self.held += data
            return
        data, self.pending = self.pending + data, b""
        passed = []
        for line in _LINE.findall(data):
            if self.held:
                self.held += line
            elif self.summarized and _TRACE.match(line):
                continue
            elif _CPP_LOG.match(line):
                self.held = line
            elif not line.endswith((b"\n", b"\r")) and _MAYBE_CPP_LOG.match(line):
                self.pending = line
            else:
                passed.append(line)
        if passed:
            self.write(b"".join(passed))

    def quiet(self) -> None:
        """Judges the held block: the runtime's fatal report becomes one line."""
        held, self.held, pending, self.pending = self.held, b"", self.pending, b""
        if FATAL in held:
            self.write(summary(self.process_id, held))
            self.summarized = True
        elif held or pending:
            self.write(held + pending)

    close = quiet


def _write_all(data: bytes) -> None:
    try:
        while data:
            data = data[os.write(1, data) :]
    except OSError:  # the reader is gone: keep draining, so the process never blocks
        pass


def main(process_id: str) -> None:
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    keep = AbortFilter(process_id, _write_all)
    held_since = last = 0.0
    while True:
        timeout = None
        if keep.holding:
            now = time.monotonic()
            timeout = max(0.0, min(last + QUIET, held_since + HOLD_AT_MOST) - now)
        ready, _, _ = select.select([0], [], [], timeout)
        if not ready:
            keep.quiet()
            continue
        data = os.read(0, 65536)
        if not data:
            keep.close()
            return
        was_holding = keep.holding
        keep.feed(data)
        last = time.monotonic()
        if keep.holding and not was_holding:
            held_since = last


def reports_shown() -> bool:
    """Whether the runtime's reports are asked for as they are (``ENV_SHOW=1``)."""
    return os.environ.get(ENV_SHOW) == "1"


def start(process_id: int) -> None:
    """Routes this process's standard error through the filter (unless ``ENV_SHOW=1``).

    Without a standard error, or when the filter cannot start, nothing changes.
    """
    import subprocess

    if reports_shown():
        return
    try:
        stderr = os.dup(2)
    except OSError:
        return
    read, write = os.pipe()
    try:
        subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, str(process_id)],
            stdin=read,
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,  # a launcher's signals to the job's group pass it by
        )
    except OSError:
        os.close(write)
        return
    finally:
        os.close(read)
        os.close(stderr)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)


if __name__ == "__main__":
    main(sys.argv[1])
