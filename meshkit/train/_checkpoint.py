"""Orbax checkpoints of the train state and the data iterator's state, and preemption."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshkit._pytree import path_str

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM after saving (EX_TEMPFAIL: "try again")."""


def abstract_like(state: Any) -> Any:
    """``jax.ShapeDtypeStruct``s with the shardings of ``state``: a restore target.

    Restoring into a state built on a new mesh re-shards the checkpoint onto it, so a
    run can resume on a different number of devices or processes.
    """
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), state
    )


def _shapes_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
    """Each leaf's shape under its path (``params/Dense_0/kernel``: keys and fields alike)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {path_str(path): tuple(leaf.shape) for path, leaf in leaves}


class Checkpointer:
    """Saves and restores ``(train state, data state)`` pairs with Orbax.

    Saves are asynchronous (the arrays are copied off the devices, then written in the
    background), happen every ``save_every`` steps, and the latest ``keep`` are kept.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> checkpointer = Checkpointer(tempfile.mkdtemp(), save_every=10, keep=2)
        >>> checkpointer.save(10, {"w": jnp.ones(3)}, {"step": 10})
        True
        >>> checkpointer.wait()
        >>> state, data = checkpointer.restore(abstract_like({"w": jnp.ones(3)}))
        >>> data, state["w"].tolist()
        ({'step': 10}, [1.0, 1.0, 1.0])
        >>> checkpointer.close()
    """

    def __init__(self, directory: str | Path, *, save_every: int, keep: int = 3):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every} and {keep}.")
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or ``None``."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (a multiple of ``save_every``)."""
        return step % self.save_every == 0

    def save(
        self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False
    ) -> bool:
        """Starts saving; returns whether a save was started."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),  # pyright: ignore[reportCallIssue]
            data=ocp.args.JsonSave(data_state),  # pyright: ignore[reportCallIssue]
        )
        return self._manager.save(step, args=args, force=force)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores the newest (or ``step``'s) checkpoint into ``target``'s structure and shardings.

        Returns the train state and the data state.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target),  # pyright: ignore[reportCallIssue]
            data=ocp.args.JsonRestore(),  # pyright: ignore[reportCallIssue]
        )
        try:
            restored = self._manager.restore(step, args=args)
        except ValueError as error:
            mismatches = self._mismatches(step, target)
            if not mismatches:
                raise
            raise ValueError(
                f"The checkpoint at step {step} in {self.directory} holds a different model: "
                + "; ".join(mismatches[:5])
                + (f" (and {len(mismatches) - 5} more)" if len(mismatches) > 5 else "")
                + ". Resume with the model that wrote it, or start this model in a new workdir."
            ) from error
        return restored["state"], dict(restored["data"])

    def _mismatches(self, step: int, target: Any) -> list[str]:
        """``"<leaf>: saved <shape>, now <shape>"`` for each leaf that differs or is in one only."""
        try:
            saved_tree = self._manager.item_metadata(step)["state"].tree
        except Exception:  # no readable metadata: nothing to compare with
            return []
        saved = _shapes_by_path(saved_tree)
        now = _shapes_by_path(target)
        lines = [
            f"{path or '<root>'}: saved {saved[path]}, now {now[path]}"
            for path in sorted(saved.keys() & now.keys())
            if saved[path] != now[path]
        ]
        lines += [
            f"{path}: saved {saved[path]}, now nothing"
            for path in sorted(saved.keys() - now.keys())
        ]
        lines += [
            f"{path}: saved nothing, now {now[path]}" for path in sorted(now.keys() - saved.keys())
        ]
        return lines

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()


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
