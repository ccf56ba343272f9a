"""The one seam to Orbax: checkpoint storage through Orbax's public API, and its errors quieted.

Everything in meshkit that names Orbax is here: the ``CheckpointManager`` and its
options, the three items a checkpoint holds (the train state, the data state as JSON
and the state's digest as JSON), the background-save checks, the removal of a failed
save's partial folder, and the filters that keep Orbax's error reports to a line. With
``_digest.py`` it forms the storage layer; the ``Checkpointer`` (``_checkpoint.py``)
decides which step to save, restore or set aside and never sees Orbax.

An Orbax upgrade that breaks meshkit breaks here. One private attribute is still read:
see ``_unfinished_writes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import re
import sys
import threading
import traceback
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from meshkit.checkpoint._digest import checkpoint_digest

TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp": a step still being written


@dataclasses.dataclass(frozen=True)
class Read:
    """What a checkpoint holds, as read.

    Attributes:
      state: the train state, in the restore target's structure and shardings.
      data: the data iterator's state.
      digest: the state's digest as saved, or ``None`` for a checkpoint saved without one.
    """

    state: Any
    data: dict[str, Any]
    digest: dict[str, list[int]] | None


class Storage:
    """Orbax's ``CheckpointManager`` over the step folders of ``directory``, latest ``keep`` kept.

    Saves are asynchronous. Each checkpoint holds three items: ``state``, ``data`` and
    ``digest`` (``checkpoint_digest``: ``tree_digest`` of the state and a checksum of
    the data state, computed at the save).
    """

    def __init__(self, directory: epath.Path, keep: int):
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            directory, options=options, handler_registry=_item_handlers()
        )
        one_line_orbax_errors()

    def folder(self, step: int) -> epath.Path:
        """The step folder of ``step``."""
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def is_due(self, step: int) -> bool:
        """Whether Orbax's own policy would save ``step`` unforced (an unsaved step, say)."""
        return self._manager.should_save(step)

    def start_save(self, step: int, state: Any, data: dict[str, Any], *, force: bool) -> bool:
        """Starts writing ``state``, ``data`` and the state's digest; returns whether it did."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),  # pyright: ignore[reportCallIssue]
            data=ocp.args.JsonSave(data),  # pyright: ignore[reportCallIssue]
            digest=ocp.args.JsonSave(checkpoint_digest(state, data)),  # pyright: ignore[reportCallIssue]
        )
        return self._manager.save(step, args=args, force=force)

    def is_saving(self) -> bool:
        """Whether a save is still being written; never waits."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Waits for the running save; raises what made it fail."""
        self._manager.wait_until_finished()

    def remove_partial(self, step: int) -> list[epath.Path]:
        """Removes the partial folders of a failed save of ``step``; returns them."""
        for write in _unfinished_writes(self._manager):  # they may still be writing into it
            with contextlib.suppress(Exception):
                write.result(timeout=60)
        partial = sorted(self.directory.glob(f"{step}{TMP_SUFFIX}*"))
        for path in partial:
            with contextlib.suppress(OSError):
                path.rmtree()
        self._manager.reload()
        return partial

    def has_digest(self, step: int) -> bool:
        """Whether ``step`` was saved with a digest (one saved before meshkit wrote one was not).

        Orbax's step metadata lists the items saved, so a digest folder deleted later
        still counts, and reading the checkpoint fails as damage.
        """
        if (self.folder(step) / "digest").is_dir():
            return True
        try:
            handlers = ocp.metadata.get_step_metadata(self.folder(step)).item_handlers
        except Exception:  # no readable metadata: nothing says a digest was saved
            return False
        return isinstance(handlers, dict) and "digest" in handlers

    def read(self, step: int, target: Any) -> Read:
        """Reads ``step`` into ``target``'s structure and shardings (no verification here).

        The step folder is read through Orbax's item handlers, not its
        ``CheckpointManager``, whose restore ends in a barrier of all processes: a
        process whose read failed would skip it while the others wait in it, and the
        processes could no longer agree to fall back. Here nothing waits for other
        processes; the ``Checkpointer`` agrees on what each one read afterwards.
        """
        with_digest = self.has_digest(step)
        items: dict[str, Any] = {
            "state": ocp.args.StandardRestore(target),  # pyright: ignore[reportCallIssue]
            "data": ocp.args.JsonRestore(),  # pyright: ignore[reportCallIssue]
        }
        if with_digest:
            items["digest"] = ocp.args.JsonRestore()  # pyright: ignore[reportCallIssue]
        silence_abandoned_reads()
        handler = ocp.CompositeCheckpointHandler(handler_registry=_item_handlers())
        try:
            restored = handler.restore(self.folder(step), args=ocp.args.Composite(**items))
        except Exception:
            collect_abandoned_reads()
            raise
        finally:
            handler.close()
        digest = dict(restored["digest"]) if with_digest else None
        return Read(state=restored["state"], data=dict(restored["data"]), digest=digest)

    def saved_state(self, step: int) -> Any | None:
        """The saved state's tree of leaf metadata (each with a ``shape``), or ``None``."""
        try:
            return self._manager.item_metadata(step)["state"].tree
        except Exception:  # no readable metadata
            return None

    def reload(self) -> None:
        """Reads the step folders again (after one was moved or removed)."""
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()


class _StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's standard handler, whose arrays are written from one replica each when
    the run has one process.

    Orbax's default cuts a replicated array into one part per replica and copies each
    part from its own device ("replica-parallel"): across the hosts of a pod that
    spreads the writes of a replicated state. In one process every part goes through
    the same host anyway, and each cut is a slicing program compiled at the first save
    (57 compiles, 3.1 of the 3.3 s of the MNIST CNN's first checkpoint on 8 CPU
    devices). The files are the same either way, and the handler reads and names
    itself as the standard one, so plain Orbax reads the checkpoint as before.
    """

    def __init__(self) -> None:
        super().__init__()
        if jax.process_count() > 1:
            return
        handlers = ocp.type_handlers
        one_replica = handlers.ArrayHandler(use_replica_parallel=False)
        registry = handlers.create_type_handler_registry(
            *(
                (kind, one_replica if kind is jax.Array else handlers.get_type_handler(kind))
                for kind in handlers.supported_types()
            )
        )
        self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)

    @classmethod
    def typestr(cls) -> str:
        return ocp.StandardCheckpointHandler.typestr()


def _item_handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Orbax's handler of each item a checkpoint holds, for saving and reading it."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    items = {
        "state": (ocp.args.StandardSave, ocp.args.StandardRestore, _StateHandler),
        "data": (ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler),
        "digest": (ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler),
    }
    for item, (save, restore, handler) in items.items():
        one = handler()
        registry.add(item, save, one)
        registry.add(item, restore, one)
    return registry


def read_pytree_as_numpy(directory: Any) -> Any:
    """A PyTree checkpoint Orbax wrote outside meshkit, arrays as numpy whatever the
    devices that wrote it (``flax.training.checkpoints`` writes these)."""
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(directory)
    tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(directory, restore_args=as_numpy)


def _unfinished_writes(manager: ocp.CheckpointManager) -> list[Any]:
    """The commit futures of ``manager``'s last save: this module's only private read of Orbax.

    Why: when one item of a save fails (the JSON data item on a full disk), Orbax's
    background thread fails at once while the other items' writes (TensorStore's
    array chunks) keep writing into the step's tmp folder. Removing that folder must
    wait for them, and Orbax has no public handle on them: ``wait_until_finished``
    returns at the first failure. Orbax 0.12 keeps them at
    ``manager._checkpointer._async_manager._commit_futures``. Should it stop doing so,
    the ``getattr`` chain yields none and nothing is waited for: the partial folder is
    then removed while chunks may still be written into it, and can be left behind.
    """
    checkpointer = getattr(manager, "_checkpointer", None)
    commits = getattr(getattr(checkpointer, "_async_manager", None), "_commit_futures", None)
    return list(commits or [])


# Orbax's errors, read and quieted.
#
# A failed Orbax save or restore is reported many times over: by several of Orbax's
# threads with full tracebacks, by asyncio for each read it abandoned, and by
# TensorStore's threads finishing reads after Orbax's event loop closed. The
# ``Checkpointer`` raises one error that names the damage and chains the first
# failure; the functions below keep the rest to a line each, or drop them.


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


_FULL = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` comes from a full disk or an exceeded quota: an ``OSError`` with
    ``ENOSPC``/``EDQUOT`` in its chain, or TensorStore's message for one (Orbax passes
    those on as ``ValueError("RESOURCE_EXHAUSTED: ... No space left on device")``)."""
    for link in chain(error):
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(link) for text in _FULL):
            return True
    return False


_quieted = threading.Event()  # the hooks below are installed once per process


def quiet_abandoned_writes() -> None:
    """Drops what Orbax's abandoned writes print after a failed save: as the
    interpreter shuts down (``Exception ignored in: <coroutine ... write_fragment>``,
    ``ImportError: sys.meta_path is None``, asyncio's ``Task exception was never
    retrieved``), and TensorStore's callbacks of failed writes into the save's event
    loop, closed by then (a bare ``RuntimeError: Event loop is closed`` traceback,
    each, at any moment: before or after the one error that says what happened).
    Installed when a checkpointer opens, since those callbacks may come before the
    failure is seen. Other unraisable exceptions and asyncio records are reported as
    before."""
    if _quieted.is_set():
        return
    _quieted.set()
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        where = getattr(unraisable.object, "__qualname__", "") or repr(unraisable.object)
        tb = unraisable.exc_traceback
        files = []
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if "orbax" in " ".join(files) or "write_fragment" in where:
            return
        closed = (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        )
        if closed and unraisable.object is None and all("asyncio" in f for f in files):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AbandonedOrbaxTasks())
    logging.getLogger("absl").addFilter(_FailedSaveLogs())


class _AbandonedOrbaxTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for Orbax's write tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            "never retrieved" in record.getMessage()
            and "orbax" in str(record.msg) + str(record.args)
        )


class _FailedSaveLogs(logging.Filter):
    """Drops Orbax's error records of a failed save, one per thread that saw it (four
    for a full disk): ``Checkpointer`` raises ``CheckpointSaveError`` for it, whose one
    line names the step, the folder, the cause and the fix."""

    _SAID = ("raised an exception", "Failed to run", "Save Finalize thread")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        return not any(text in record.getMessage() for text in self._SAID)


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
    return closed_loop or _raised_in_orbax(exc_value) or _tensorstore_read(exc_value)


_TENSORSTORE_STATUS = re.compile(r"^[A-Z_]+: Error reading ")


def _tensorstore_read(exc_value: BaseException) -> bool:
    """Whether ``exc_value`` is TensorStore's own error for a read (set on an asyncio
    future from its C++ threads, so no Python frame of Orbax's is in it)."""
    return not exc_value.__traceback__ and bool(_TENSORSTORE_STATUS.match(str(exc_value)))


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
