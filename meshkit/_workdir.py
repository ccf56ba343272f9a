"""A workdir belongs to one run at a time, and meshkit writes only what is its own.

A run claims its workdir before it writes there: process 0 takes a lock on the
folder's marker file, ``.meshkit-run``, which names the run holding it (host, pid,
start, command). The lock is the operating system's (``fcntl.lockf``), so a killed
run leaves none behind: the next run takes it and overwrites the stale names. A
second run into a held workdir ends at once with a ``WorkdirError`` naming the first.

The marker also says that meshkit made the folder. A folder without one that holds a
file or folder under a name a run writes (``config.json``, ``checkpoints``...) which
meshkit cannot recognise as its own is refused, naming them, so that a run never
overwrites, appends to or deletes a user's files. A folder an older meshkit wrote
(its ``config.json`` says so, its ``checkpoints`` hold only step folders) is adopted.

Object-store workdirs (``gs://``) get the marker and the check of foreign files, but
no lock: stores have no locks a killed run would release.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import pathlib
import re
import socket
import sys
import warnings
from collections.abc import Collection, Iterator

import jax
from etils import epath
from jax.experimental import multihost_utils

from meshkit._host import row_text, text_row
from meshkit._paths import PathLike, as_path, check_store_packages, is_remote

MARKER = ".meshkit-run"
"""The file that marks a folder as a meshkit workdir; a run holds a lock on it."""

RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "summary.json")
"""The names a training run writes in its workdir: what a folder without the marker
may not hold unless meshkit recognises it as its own."""

_STEP_FOLDER = re.compile(r"\d+(\.damaged(-\d+)?|\.orbax-checkpoint-tmp.*)?")
_MESSAGE_BYTES = 4096

_held: dict[str, int | None] = {}
"""This process's claimed workdirs: the marker's open descriptor that holds the lock
(``None`` on an object store, or where the file system has no locks)."""


class WorkdirError(ValueError):
    """A workdir another run holds, or one holding files meshkit did not write."""


@contextlib.contextmanager
def claimed(workdir: PathLike, *, writes: Collection[str] = RUN_FILES) -> Iterator[epath.Path]:
    """``claim_workdir``s ``workdir`` for the ``with`` block and releases it after, unless this
    process held it already (a recipe claims its workdir before calling ``fit``).

    Examples:
        >>> import tempfile
        >>> with claimed(tempfile.mkdtemp()) as path:
        ...     (path / MARKER).exists()
        True
    """
    key = os.fspath(as_path(workdir))
    taken = key not in _held
    path = claim_workdir(workdir, writes=writes)
    try:
        yield path
    finally:
        if taken:
            release_workdir(path)


def claim_workdir(
    workdir: PathLike, *, writes: Collection[str] = RUN_FILES, fresh: bool = False
) -> epath.Path:
    """Takes ``workdir`` for this process's run until ``release_workdir`` or the process ends;
    returns it as a path, made if missing. Process 0 takes it and every process gets
    the outcome (call it on every process). Claiming one this process holds is a no-op.

    Args:
      workdir: the run's folder (local, or an object-store URI).
      writes: the names (or glob patterns, ``stage_*``) the run writes there:
        ``RUN_FILES``, plus a sweep's own.
      fresh: then delete what a meshkit run wrote under ``writes`` (a recipe's
        ``--fresh``); in ``checkpoints`` only the step folders, so that anything else
        put there stays.

    Raises:
      WorkdirError: another run holds ``workdir`` (the message names it), or the folder
        has no marker and holds files under ``writes`` that meshkit did not write.

    Examples:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "config.json").write_text("{}")  # not meshkit's
        >>> claim_workdir(folder)
        Traceback (most recent call last):
        ...
        meshkit._workdir.WorkdirError: The workdir ... holds config.json, which meshkit did ...
    """
    check_store_packages(workdir)
    path = as_path(workdir)
    key = os.fspath(path)
    if key not in _held:
        problem = _take(path, writes) if jax.process_index() == 0 else ""
        problem = _from_process_0(problem)
        if problem:
            raise WorkdirError(problem)
        _held.setdefault(key, None)
    if fresh:
        if jax.process_index() == 0:
            _clear(path, writes)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("meshkit --fresh")
    return path


def release_workdir(workdir: PathLike) -> None:
    """Lets another run claim ``workdir`` (its marker stays)."""
    descriptor = _held.pop(os.fspath(as_path(workdir)), None)
    if descriptor is not None:
        os.close(descriptor)  # closing the descriptor releases the lock


def _take(path: epath.Path, writes: Collection[str]) -> str:
    """Process 0's claim: ``""``, or why ``path`` cannot be taken."""
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER
    if not marker.exists():
        foreign = _foreign(path, writes)
        if foreign:
            return (
                f"The workdir {path} holds {_listed(foreign)}, which meshkit did not write "
                f"(the folder has no {MARKER} marker), and a run would overwrite "
                f"{'them' if len(foreign) > 1 else 'it'}: choose a new or empty workdir."
            )
    holder = json.dumps(_holder(), indent=1) + "\n"
    if is_remote(path):
        marker.write_text(holder)
        _held[os.fspath(path)] = None
        return ""
    descriptor = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl

        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # no locks on this file system
            warnings.warn(
                f"The file system of {path} has no file locks ({error.strerror}): meshkit "
                "cannot stop a second run from writing into this workdir at the same time.",
                stacklevel=3,
            )
        else:
            message = _in_use(path, os.pread(descriptor, 1 << 16, 0))
            os.close(descriptor)
            return message
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, holder.encode(), 0)
    _held[os.fspath(path)] = descriptor
    return ""


def _holder() -> dict[str, object]:
    from meshkit import __version__

    return {
        "written_by": f"meshkit {__version__}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "processes": jax.process_count(),
    }


def _in_use(path: epath.Path, recorded: bytes) -> str:
    try:
        holder = json.loads(recorded)
        who = (
            f"pid {holder['pid']} on {holder['host']}, started {holder['started']} "
            f"({holder['command']})"
        )
    except (ValueError, KeyError, TypeError):
        who = "a run whose marker names no holder yet"
    return (
        f"The workdir {path} is in use by another run: {who}. Wait for it to end (or stop "
        "it), or choose another workdir."
    )


def _clear(path: epath.Path, writes: Collection[str]) -> None:
    """Deletes what a meshkit run wrote under ``writes`` in the claimed ``path``."""
    for pattern in writes:
        for item in path.glob(pattern):
            if item.name == "checkpoints" and item.is_dir():
                for step in item.iterdir():
                    if _STEP_FOLDER.fullmatch(step.name):
                        step.rmtree()
                if not any(item.iterdir()):
                    item.rmdir()
            elif item.is_dir():
                item.rmtree()
            else:
                item.unlink()


def _foreign(path: epath.Path, writes: Collection[str]) -> list[str]:
    """The names under ``writes`` in ``path`` that meshkit cannot recognise as its own."""
    found = sorted({item.name for pattern in writes for item in path.glob(pattern)})
    return [name for name in found if not _recognised(path / name)]


def _recognised(item: epath.Path) -> bool:
    """Whether ``item`` is something a meshkit run wrote (an older one, without a marker)."""
    if item.name == "checkpoints":
        return item.is_dir() and all(_STEP_FOLDER.fullmatch(c.name) for c in item.iterdir())
    if item.name == "config.json":
        versions = _json_object(item).get("versions")
        return isinstance(versions, dict) and "meshkit" in versions
    if item.name == "metrics.jsonl":
        with item.open() as lines:
            return "step" in _json_object_text(lines.readline())
    # Other names (summary.json, a sweep's results) count where the run's config does.
    config = item.parent / "config.json"
    return config.exists() and _recognised(config)


def _json_object(item: epath.Path) -> dict[str, object]:
    return _json_object_text(item.read_text()) if item.is_file() else {}


def _json_object_text(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _from_process_0(problem: str) -> str:
    """Process 0's ``problem`` on every process (the same string where there is one)."""
    if jax.process_count() == 1:
        return problem
    return row_text(multihost_utils.broadcast_one_to_all(text_row(problem, _MESSAGE_BYTES)))
