"""Checkpoint policy: which step to save or restore, fallback past damage, agreement of processes.

The storage itself (Orbax, through ``_orbax.Storage``, and the digest) is below this
module; nothing here names Orbax.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from meshkit._host import row_text, text_row
from meshkit._paths import PathLike, as_path
from meshkit._pytree import path_str
from meshkit.checkpoint._digest import DigestCompile, checkpoint_damage
from meshkit.checkpoint._orbax import (
    Storage,
    disk_full,
    os_error,
    quiet_abandoned_writes,
    root_cause,
)


class CheckpointDamagedError(RuntimeError):
    """A checkpoint could not be read, or what was read differs from the digest saved with it.

    Attributes:
      step: the damaged checkpoint's step.
      folder: its step folder.
      damage: what is wrong, in a few words.
    """

    def __init__(self, message: str, *, step: int, folder: epath.Path, damage: str):
        super().__init__(message)
        self.step = step
        self.folder = folder
        self.damage = damage


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (a full disk, say); its partial folder was removed."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """The checkpoint ``Checkpointer.resume`` restored.

    Attributes:
      step: its step.
      state: the train state, in the restore target's structure and shardings.
      data: the data iterator's state.
      set_aside: where the damaged newer step folders were moved to reach it.
    """

    step: int
    state: Any
    data: dict[str, Any]
    set_aside: tuple[epath.Path, ...] = ()


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


_DAMAGE_BYTES = 1024  # of each process's description of the damage it found


def _agreed_damage(damage: str) -> str:
    """The damage one process found, the same on every process; ``""`` if none found any.

    Every process reads its own part of a checkpoint, so one may find damage where the
    others read intact values. The processes exchange what they found (one collective,
    reached by every process whether its read failed or not), and all of them treat
    the step as damaged if any did, so they never restore different steps. The first
    process's description is used; with several processes it names that process.
    """
    if jax.process_count() == 1:
        return damage
    found = np.asarray(multihost_utils.process_allgather(text_row(damage, _DAMAGE_BYTES)))
    first = next((i for i, row in enumerate(found) if row.any()), None)
    if first is None:
        return ""
    described = row_text(found[first])
    count, total = int(found.any(axis=1).sum()), jax.process_count()
    return f"{described} (process {first}'s finding; {count} of {total} processes found damage)"


class Checkpointer:
    """Saves and restores ``(train state, data state)`` pairs with Orbax, verified by a digest.

    Saves are asynchronous (the arrays are copied off the devices, then written in the
    background), happen every ``save_every`` steps, and the latest ``keep`` are kept.
    Each checkpoint also holds a digest of the state (``tree_digest``) and of the data
    state, checked when it is restored: damaged files, or an edited data state, raise
    ``CheckpointDamagedError`` instead of restoring wrong values or a wrong position.
    A failed background save raises ``CheckpointSaveError`` at the next call to
    ``should_save``, ``save``, ``wait`` or ``close``.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> checkpointer = Checkpointer(tempfile.mkdtemp(), save_every=10, keep=2)
        >>> checkpointer.save(10, {"w": jnp.ones(3)}, {"step": 10})
        True
        >>> checkpointer.wait()
        >>> state, data = checkpointer.restore({"w": jnp.ones(3)})
        >>> data, state["w"].tolist()
        ({'step': 10}, [1.0, 1.0, 1.0])
        >>> checkpointer.close()
    """

    def __init__(self, directory: PathLike, *, save_every: int, keep: int = 3):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every} and {keep}.")
        self.directory = as_path(directory)
        self.save_every = save_every
        self._storage = Storage(self.directory, keep)
        self._pending: int | None = None  # the step of a save that may still be running
        self._digest_compile: DigestCompile | None = None
        quiet_abandoned_writes()  # a failed save's writes may complain before it is seen

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or ``None``."""
        return self._storage.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (a multiple of ``save_every``).

        Called at every step, it first reports a failed background save (``check``).
        """
        self.check(step)
        return step % self.save_every == 0

    def prepare(self, state: Any) -> None:
        """Starts compiling the digest of states like ``state`` in the background.

        Where the digest is a jitted program (on accelerators, and on CPUs with
        several processes) a first save or restore would wait for its compile; after
        ``prepare`` it compiles while the train step does. Optional (``fit`` calls
        it); nothing is compiled where the digest is computed in numpy.
        """
        self._digest_compile = DigestCompile(state)

    def _digest_compiled(self) -> None:
        if self._digest_compile is not None:
            self._digest_compile.wait()
            self._digest_compile = None

    def save(
        self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False
    ) -> bool:
        """Starts saving ``state``, ``data_state`` and the state's digest; returns whether it did.

        Raises:
          CheckpointSaveError: the previous save failed in the background, or this
            one could not start (an ``OSError`` such as a full disk).
        """
        if not force and not self._storage.is_due(step):
            return False
        self._finish(step)
        self._digest_compiled()
        try:
            started = self._storage.start_save(step, state, data_state, force=force)
        except Exception as error:
            if os_error(error) is None:
                raise
            failure = self._save_failed(step, error, step)
            if disk_full(error) and os_error(error) is None:
                raise failure from None
            raise failure from error
        self._pending = step if started else None
        return started

    def check(self, step: int | None = None) -> None:
        """Raises ``CheckpointSaveError`` if the last save failed; never waits for one.

        ``step``, the step training reached, goes into the message.
        """
        if self._pending is not None and not self._storage.is_saving():
            self._finish(step)

    def _finish(self, stopped_at: int | None = None) -> None:
        """Waits for the pending save; its failure becomes a ``CheckpointSaveError``."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._storage.wait()
        except Exception as error:
            failure = self._save_failed(step, error, stopped_at)
            if disk_full(error) and os_error(error) is None:  # TensorStore's: said in full,
                raise failure from None  # and Orbax's long traceback would only bury it
            raise failure from error

    def _save_failed(
        self, step: int, error: BaseException, stopped_at: int | None = None
    ) -> CheckpointSaveError:
        """Removes the partial folder of ``step``; the error to raise, in one line."""
        quiet_abandoned_writes()
        partial = self._storage.remove_partial(step)
        system = os_error(error)
        full = disk_full(error)
        latest = self._storage.latest_step()
        stopped = (
            f"Training stopped at step {stopped_at}"
            if stopped_at is not None
            else "Training stopped"
        )
        removed = f" and the partial folder {partial[0].name} was removed" if partial else ""
        resume = f"resume from step {latest}" if latest is not None else "start over"
        fix = "Free space on that file system (or keep fewer checkpoints)" if full else "Fix that"
        cause = str(system) if system is not None else root_cause(error)
        if full and system is None:
            cause = "No space left on device (or the disk quota is exceeded)"
        return CheckpointSaveError(
            f"Saving the checkpoint of step {step} in {self.directory} failed: "
            f"{cause}. {stopped}{removed}. {fix}, then rerun the same command to {resume}."
        )

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores the newest (or ``step``'s) checkpoint into ``target``'s structure and shardings.

        ``target`` is a state like the saved one, live or abstract (``jax.ShapeDtypeStruct``
        leaves with shardings, e.g. from ``abstract_train_state``): only its structure,
        shapes, dtypes and shardings are used, so restoring into a state built on another
        mesh re-shards the checkpoint onto that mesh. Returns the train state and the
        data state, after checking the state against the digest saved with it.

        Raises:
          CheckpointDamagedError: a file of the checkpoint is missing or cut short, or
            the values read differ from the digest (a flipped bit, overwritten bytes).
          ValueError: the checkpoint holds a different model (the leaves that differ).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        target = abstract_like(target)
        try:
            read, failure, damage = self._storage.read(step, target), None, ""
        except Exception as error:
            self._raise_if_another_model(step, target, error)
            read, failure, damage = None, error, f"it could not be read ({root_cause(error)})"
        # Every process learns whether any read failed (the others may have read their
        # parts intact), before the digest check's own collectives.
        if damage := _agreed_damage(damage):
            raise self._damaged(step, damage) from failure
        assert read is not None
        self._digest_compiled()
        if read.digest is None:
            warnings.warn(
                f"The checkpoint of step {step} in {self.directory} has no digest (it was "
                "written before meshkit saved one): restored without verification.",
                stacklevel=2,
            )
        elif damage := _agreed_damage(checkpoint_damage(read.digest, read.state, read.data)):
            raise self._damaged(step, damage)
        return read.state, read.data

    def _damaged(self, step: int, damage: str) -> CheckpointDamagedError:
        folder = self._storage.folder(step)
        return CheckpointDamagedError(
            f"The checkpoint of step {step} in {folder} is damaged: {damage}. Move that "
            "folder out of the checkpoints directory (or delete it) and rerun to resume "
            "from the checkpoint before it.",
            step=step,
            folder=folder,
            damage=damage,
        )

    def resume(self, target: Any) -> Restored | None:
        """Restores the newest intact checkpoint into ``target``; ``None`` if there is none.

        A damaged newer checkpoint is moved aside to ``<step>.damaged`` (so that its
        step can be saved again) with a warning naming it and the damage, and the one
        before it is tried. With several processes, a step is damaged for all of them
        when any one finds damage in its part, so every process resumes from the same
        step. When no checkpoint is intact, ``CheckpointDamagedError`` is raised and
        nothing is moved.
        """
        steps = self._storage.steps()
        if not steps:
            _refuse_flax_checkpoints(self.directory)
        damaged: list[CheckpointDamagedError] = []
        for step in reversed(steps):
            try:
                state, data = self.restore(target, step)
            except CheckpointDamagedError as error:
                damaged.append(error)
                continue
            moved = tuple(self._set_aside(error.step) for error in damaged)
            for error, path in zip(damaged, moved, strict=True):
                warnings.warn(
                    f"The checkpoint of step {error.step} in {error.folder} is damaged: "
                    f"{error.damage}. Resuming from step {step}, the newest intact "
                    f"checkpoint; the damaged folder was moved to {path} (inspect or delete it).",
                    stacklevel=2,
                )
            return Restored(step=step, state=state, data=data, set_aside=moved)
        if damaged:
            newest = damaged[0]
            raise CheckpointDamagedError(
                f"No checkpoint in {self.directory} is intact: "
                + "; ".join(f"step {error.step}: {error.damage}" for error in damaged)
                + f". Move {self.directory} aside to start the run over.",
                step=newest.step,
                folder=newest.folder,
                damage=newest.damage,
            ) from None  # the message names each step's damage; the chain was Orbax's
        return None

    def _set_aside(self, step: int) -> epath.Path:
        """Moves step ``step``'s folder to ``<step>.damaged`` (process 0 moves, all wait)."""
        folder = self._storage.folder(step)
        aside, n = folder.with_name(f"{step}.damaged"), 1
        while aside.exists():
            n += 1
            aside = folder.with_name(f"{step}.damaged-{n}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"meshkit checkpoint {step}: named")
        if jax.process_index() == 0:
            folder.rename(aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"meshkit checkpoint {step}: moved")
        self._storage.reload()
        return aside

    def _raise_if_another_model(self, step: int, target: Any, error: BaseException) -> None:
        """Raises ``ValueError`` naming the leaves that differ if ``target`` is another model."""
        mismatches = self._mismatches(step, target)
        if mismatches and all(line.startswith("loss_scale") for line in mismatches):
            saved_f16 = any(" now nothing" in line for line in mismatches)
            raise ValueError(
                f"The checkpoint at step {step} in {self.directory} holds the same model "
                "with another precision: "
                + (
                    "it was saved with a float16 loss scale (precision='f16') and this "
                    "state has none. Resume with precision='f16' (--precision f16)"
                    if saved_f16
                    else "this state has a float16 loss scale (precision='f16') and the "
                    "checkpoint has none. Resume with the precision it was saved with "
                    "(f32 or bf16)"
                )
                + ", or start in a new workdir."
            ) from None
        if mismatches:
            raise ValueError(
                f"The checkpoint at step {step} in {self.directory} holds a different model: "
                + "; ".join(mismatches[:5])
                + (f" (and {len(mismatches) - 5} more)" if len(mismatches) > 5 else "")
                + ". Resume with the model that wrote it, or start this model in a new workdir."
            ) from None  # the differences are named; Orbax's structure error adds only lines

    def _mismatches(self, step: int, target: Any) -> list[str]:
        """``"<leaf>: saved <shape>, now <shape>"`` for each leaf that differs or is in one only."""
        saved_tree = self._storage.saved_state(step)
        if saved_tree is None:  # no readable metadata: nothing to compare with
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
        """Blocks until pending saves are on disk; raises ``CheckpointSaveError`` if one failed."""
        self._finish()
        self._storage.wait()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        try:
            self._digest_compiled()
            self._finish()
        finally:
            self._storage.close()


def _refuse_flax_checkpoints(directory: epath.Path) -> None:
    """Raises when ``directory`` holds no meshkit checkpoint but ``flax.training.checkpoints``
    ones (``checkpoint_<step>``): resuming would silently start over."""
    if not directory.is_dir():
        return
    flax_entries = sorted(p.name for p in directory.iterdir() if p.name.startswith("checkpoint_"))
    if flax_entries:
        raise ValueError(
            f"{directory} holds no meshkit checkpoint, but {len(flax_entries)} written by "
            f"flax.training.checkpoints ({', '.join(flax_entries[-3:])}): a pmap program's. "
            "Read them into a state with meshkit.train.import_flax_checkpoint(directory, "
            "state), and give fit (or the Checkpointer) a directory of its own."
        )
