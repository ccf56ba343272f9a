"""Children that die with their parent, however the parent dies.

A launcher starts its children in their own sessions, so that a Ctrl-C or a closed
terminal reaches them only through the launcher. The price is that nothing kills them
when the launcher itself is killed (SIGKILL, a crash, an out-of-memory kill): they are
re-parented to PID 1 and run on unsupervised. A ``Watchdog`` is a small process that
holds the read end of a pipe from the launcher; the kernel closes the write end when
the launcher dies, however it dies, and the watchdog then kills the process groups it
was told about. Unlike Linux's parent-death signal it also works on macOS and reaches
the children's own children.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Sequence

# The watchdog's program: standard library only, so it starts in milliseconds. It reads
# "+PGID" (watch this group), "-PGID" (it has exited) and "done" (the launcher ended
# normally) from stdin; at end of file without "done" it kills every watched group.
_PROGRAM = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    word = line.strip()
    if word == "done":
        sys.exit(0)
    if word[:1] == "+":
        groups.add(int(word[1:]))
    elif word[:1] == "-":
        groups.discard(int(word[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class Watchdog:
    """Kills the process groups it watches if this process dies before calling ``close``.

    Examples:
        >>> import subprocess, sys
        >>> watchdog = Watchdog()
        >>> child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
        >>> watchdog.watch(child.pid)
        >>> child.wait()
        0
        >>> watchdog.poll([child])  # reports the exit, so that the id is forgotten
        [0]
        >>> watchdog.close()
    """

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _PROGRAM],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C or hangup to our group does not reach it
        )
        self._watched: set[int] = set()

    def watch(self, group: int) -> None:
        """Kill process group ``group`` (a child started with a new session) if we die."""
        self._watched.add(group)
        self._send(f"+{group}")

    def exited(self, group: int) -> None:
        """Forget ``group``: its leader has exited and been reaped, so the id may be reused."""
        self._watched.discard(group)
        self._send(f"-{group}")

    def poll(self, children: Sequence[subprocess.Popen[bytes]]) -> list[int | None]:
        """Each child's exit code (``None`` while it runs); forgets those that have exited."""
        codes = [child.poll() for child in children]
        for child, code in zip(children, codes, strict=True):
            if code is not None and child.pid in self._watched:
                self.exited(child.pid)
        return codes

    def close(self) -> None:
        """Tells the watchdog that we ended normally; it exits without killing anything."""
        self._send("done")
        stdin = self._process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.close()
        self._process.wait()

    def _send(self, line: str) -> None:
        stdin = self._process.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(OSError):  # the watchdog was killed: nothing to tell
            stdin.write(f"{line}\n".encode())
            stdin.flush()
