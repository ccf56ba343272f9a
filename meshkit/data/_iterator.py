"""Global batches from a pipeline: placed on the mesh ahead of use, with a resumable state."""

from __future__ import annotations

import collections
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from meshkit._batch import place_local_rows
from meshkit.data._ahead import PlacedAhead, places_in_thread
from meshkit.data._pipeline import EvalPipeline, TrainPipeline


def drop_grain_note(error: BaseException) -> None:
    """Removes the note Grain adds to an error raised in a transform ("Grain has
    removed its internal frames ..."): printed after the message, it became the last
    line a user read, below the line that names the cause."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [n for n in notes if "Grain has removed its internal frames" not in n]


class GlobalBatchIterator(Iterator[dict[str, jax.Array]]):
    """Iterates global ``jax.Array`` batches, each placed on the devices ``prefetch`` steps early.

    Each process-local batch from the pipeline becomes a global array with
    ``meshkit.shard_batch`` (no cross-process communication). Who places it follows
    the pipeline's ``InputSettings.placement``: on a CPU (``'auto'``) the caller's
    thread, queued asynchronously like a step, so the host-to-device copies of the
    next ``prefetch`` batches overlap the steps already queued and nothing competes
    with the training loop for the interpreter; on a GPU or TPU a thread of its own
    that keeps ``prefetch`` batches placed, so the caller only takes them. (Per-example
    work runs in the pipeline's own threads or worker processes.) ``state()`` is a small JSON-able
    dict (step, seed, shuffle, global batch size, source fingerprint) for checkpoints;
    passing it back as ``state=`` resumes at that step, and is refused if the seed,
    shuffle setting, batch size or data differ.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit.data import ArraySource, GlobalBatchIterator, TrainPipeline
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> pipeline = TrainPipeline(ArraySource({"x": np.arange(64.0)}), global_batch_size=16,
        ...                          sharding=meshkit.batch_sharding(mesh), seed=3)
        >>> batches = GlobalBatchIterator(pipeline)
        >>> first = next(batches)
        >>> first["x"].shape, batches.state()["step"]
        ((16,), 1)
        >>> resumed = GlobalBatchIterator(pipeline, state=batches.state())
        >>> bool((next(resumed)["x"] == next(batches)["x"]).all())
        True
        >>> batches.close(); resumed.close()
    """

    def __init__(
        self,
        pipeline: TrainPipeline | EvalPipeline,
        *,
        state: Mapping[str, Any] | None = None,
        prefetch: int = 2,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 batches, got {prefetch}.")
        self.pipeline = pipeline
        self.prefetch = prefetch
        self._step = 0 if state is None else check_state(pipeline, state)
        self.wait_seconds = 0.0
        """Time ``next()`` spent getting batches (host gather and placement): input-bound
        time, after the first batch."""
        self.startup_seconds = 0.0
        """Time the first ``next()`` took: opening the pipeline (its threads or worker
        processes) and building the first batches. A one-off, like a compilation."""
        self._local: Any = None  # the pipeline's iterator, opened by the first next()
        self._placed: collections.deque[dict[str, jax.Array]] = collections.deque()
        self._ahead: PlacedAhead[dict[str, jax.Array]] | None = None  # placing thread's
        self.in_thread = places_in_thread(pipeline.input_settings.placement, pipeline.sharding)
        """Whether a thread of its own places the batches (else ``next()`` does)."""
        self._exhausted = False
        self._error: Exception | None = None  # building a later batch failed: raised in turn
        self._closed = False

    def __next__(self) -> dict[str, jax.Array]:
        started = time.perf_counter()
        first = self._local is None
        try:
            return self._next()
        except Exception as error:
            drop_grain_note(error)
            raise
        finally:
            seconds = time.perf_counter() - started
            if first:
                self.startup_seconds += seconds
            else:
                self.wait_seconds += seconds

    def _next(self) -> dict[str, jax.Array]:
        if self._closed:
            raise RuntimeError("This GlobalBatchIterator was closed.")
        pipeline = self.pipeline
        if self._local is None:
            self._local = pipeline.local_batches(self._step)
            if self.in_thread:
                self._ahead = PlacedAhead(
                    self._local,
                    lambda local: place_local_rows(
                        local, pipeline.sharding, pipeline.global_batch_size
                    ),
                    ahead=max(1, self.prefetch),
                )
                weakref.finalize(self, self._ahead.stop)  # dropped without close()
        if self._ahead is not None:
            placed = next(self._ahead)  # StopIteration at the end, as below
            self._step += 1
            return placed
        while len(self._placed) <= self.prefetch and not self._exhausted:
            try:
                local = next(self._local)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as error:
                if not self._placed:
                    raise
                self._error, self._exhausted = error, True  # the batches before it come first
                break
            self._placed.append(
                place_local_rows(local, pipeline.sharding, pipeline.global_batch_size)
            )
        if not self._placed:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration
        self._step += 1
        return self._placed.popleft()

    def __iter__(self) -> GlobalBatchIterator:
        return self

    def __len__(self) -> int:
        """Batches left, for finite pipelines."""
        total = self.pipeline.num_steps
        if total is None:
            raise TypeError("An endless training pipeline has no length; pass num_epochs.")
        return total - self._step

    @property
    def step(self) -> int:
        """The step of the next batch ``next()`` returns."""
        return self._step

    def state(self) -> dict[str, Any]:
        """The JSON-able data state to checkpoint beside the model."""
        return {"step": self._step, **self.pipeline.state_fields()}

    def close(self) -> None:
        """Releases the placed batches and the pipeline's iterator (and its threads)."""
        self._closed = True
        self._placed.clear()
        if self._ahead is not None:
            self._ahead.close()  # stops the thread, then closes the pipeline's iterator
        else:
            close = getattr(self._local, "close", None)
            if close is not None:
                close()
        self._ahead = None
        self._local = None

    def __enter__(self) -> GlobalBatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LATER_FIELDS = frozenset({"shuffle"})
"""State fields that data states saved by earlier meshkit versions lack.

Such a state still resumes; a field it lacks is unknown, so it is not compared (a
``UserWarning`` names it)."""


def check_state(pipeline: TrainPipeline | EvalPipeline, state: Mapping[str, Any]) -> int:
    """Validates a saved data state against ``pipeline``; returns the step to resume at.

    Every field of ``pipeline.state_fields()`` (seed, shuffle, global batch size, data
    fingerprint, ...) must equal the saved one: a different value would feed other
    batches than the interrupted run saw. A field added in a later meshkit version
    (``shuffle``) that an older state lacks is unknown: it is not compared, and a
    ``UserWarning`` says so.

    Raises:
        ValueError: The state lacks a field, a field differs (the message names the
            saved and current values), or its step is outside the pipeline's steps.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit.data import ArraySource, TrainPipeline
        >>> sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
        >>> pipeline = TrainPipeline(ArraySource({"x": np.arange(16.0)}), global_batch_size=8,
        ...                          sharding=sharding, shuffle=False)
        >>> saved = {"step": 1, **pipeline.state_fields(), "shuffle": True}
        >>> try:
        ...     check_state(pipeline, saved)
        ... except ValueError as error:
        ...     print(str(error).split("(")[1].split(")")[0])
        shuffle: saved True, now False
    """
    expected = pipeline.state_fields()
    missing = sorted({"step", *expected} - _LATER_FIELDS - set(state))
    if missing:
        raise ValueError(
            f"The data state {dict(state)} lacks {missing}; it was not saved by meshkit."
        )
    unknown = sorted((_LATER_FIELDS & set(expected)) - set(state))
    if unknown:
        now = ", ".join(f"{key}={expected[key]!r}" for key in unknown)
        warnings.warn(
            f"The saved data state has no {unknown} (saved by an earlier meshkit), so it "
            f"cannot be checked; resuming assumes the interrupted run used {now} too.",
            stacklevel=3,
        )
    differ = {
        key: (state[key], value)
        for key, value in expected.items()
        if key in state and state[key] != value
    }
    if differ:
        details = "; ".join(
            f"{key}: saved {saved!r}, now {now!r}" for key, (saved, now) in differ.items()
        )
        raise ValueError(
            f"Cannot resume: the saved data state does not match this pipeline ({details}). "
            "Resuming would feed different batches than the interrupted run. Use the same "
            "seed, shuffle setting, global batch size and data, or start from a fresh work "
            "directory."
        )
    step = state["step"]
    total = pipeline.num_steps
    if not isinstance(step, int) or step < 0 or (total is not None and step > total):
        raise ValueError(f"The saved step {step!r} is outside this pipeline's [0, {total}] steps.")
    return step
