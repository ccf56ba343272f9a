"""Orbax checkpoints of the train state and the data iterator's state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshkit._pytree import path_str


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
