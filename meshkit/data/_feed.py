"""How batches reach the devices: one feed for ``fit``'s step program and for loops of one's own.

A ``Feed`` reads a pipeline from a step on and delivers its batches placed on the
mesh, keeping the data state a checkpoint records and the seconds spent waiting.

- host input: each process's batches become global arrays (``meshkit.shard_batch``'s
  placement, no cross-process communication). Who places them follows the pipeline's
  ``InputSettings.placement``: on a CPU (``'auto'``) the caller's thread, on a GPU or
  TPU a thread of its own that keeps the next batches placed (``PlacedAhead``), so
  their copies overlap the steps under way and the caller only takes them. Chunks
  are stacked on the host and placed in one transfer either way (the thread builds
  whole chunks of the size the loop runs ahead).
- resident data (``InputSettings(resident=True)``): the dataset is on the devices
  already, and a block of the source indices of many steps is placed once for all of
  them; a step's batch is gathered on the devices.

``fit`` takes chunks: ``next(steps)`` gives ``(data, xs, offset)``, ``xs`` holding one
entry per step from ``offset`` on (a stack of batches, or the index block) and
``batch_of(data, x)`` the step's batch inside the program. ``GlobalBatchIterator``,
the public face for loops of one's own and for evaluation, takes one placed batch at
a time. A data state saved by either resumes with the other.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from meshkit._batch import place_local_rows, place_stacked_rows, stacked_sharding
from meshkit.data._ahead import PlacedAhead, places_in_thread
from meshkit.data._pipeline import EvalPipeline, TrainPipeline
from meshkit.data._resident import ResidentData

BLOCK_STEPS = 512
"""Steps of resident indices placed at once (at least the largest chunk)."""


def drop_grain_note(error: BaseException) -> None:
    """Removes the note Grain adds to an error raised in a transform ("Grain has
    removed its internal frames ..."): printed after the message, it became the last
    line a user read, below the line that names the cause."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [n for n in notes if "Grain has removed its internal frames" not in n]


def whole_batch(data: Any, x: Any) -> Any:
    """``batch_of`` for host input: the entry is the batch."""
    del data
    return x


class Feed:
    """The batches of ``pipeline`` from ``state``'s step on, placed on the devices.

    Args:
      pipeline: the data.
      state: a data state saved by ``state()`` (its step is where the feed starts).
      largest: the most steps one ``next`` asks for (resident index blocks hold whole
        chunks of it).
      stacked: chunks for ``fit`` (host batches placed with a leading step axis, or
        resident indices; a placing thread keeps two whole chunks ready), or host
        batches as they are (``GlobalBatchIterator``).
      prefetch: for batches as they are: how many the caller's thread places ahead
        of use (a placing thread keeps at least as many ready).
    """

    def __init__(
        self,
        pipeline: TrainPipeline | EvalPipeline,
        state: Mapping[str, Any] | None = None,
        *,
        largest: int = 1,
        stacked: bool = True,
        prefetch: int = 0,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 batches, got {prefetch}.")
        self.pipeline = pipeline
        self.step = 0 if state is None else check_state(pipeline, state)
        self.resident = stacked and getattr(pipeline, "resident_mode", None) is not None
        self.in_thread = not self.resident and places_in_thread(
            pipeline.input_settings.placement, pipeline.sharding
        )
        """Whether a thread of its own places the batches (else the caller's thread does)."""
        self.prefetch = prefetch
        self.wait_seconds = 0.0
        """Time spent getting input (host gather and placement) after the first."""
        self.startup_seconds = 0.0
        """Time the first input took: opening the pipeline (its threads or worker
        processes) or placing the dataset, and building the first batches."""
        self._stacked = stacked
        self._started = False
        self._closed = False
        self._local: Iterator[Any] | None = None  # the pipeline's iterator, opened on first use
        self._ahead: PlacedAhead[Any] | None = None  # the placing thread's
        self._placed: collections.deque[Any] = collections.deque()  # placed ahead, in the loop
        self._error: Exception | None = None  # building a later batch failed: raised in turn
        self._exhausted = False
        self._rows: _Rows | None = None  # host input in chunks: what they are built from
        self._chunk: _PlacedChunk | None = None  # host input: the chunk under way
        self._block: Any = None  # resident: indices of steps _block_start ..
        self._block_start = 0
        self._block_steps = max(largest, BLOCK_STEPS // largest * largest)

    @property
    def batch_of(self) -> Callable[[Any, Any], Any]:
        """``batch_of(data, x) -> batch`` inside the step program."""
        resident = self._resident_data()
        return whole_batch if resident is None else resident.gather

    def _resident_data(self) -> ResidentData | None:
        """The dataset on the devices where this feed gathers from it (``None``: host
        input); placed on first use, which counts as start-up."""
        return getattr(self.pipeline, "resident_data", None) if self.resident else None

    def next(self, steps: int, *, chunk: int | None = None) -> tuple[Any, Any, int]:
        """``(data, xs, offset)`` for the next ``steps`` steps, ``xs``'s entries ``offset``
        on; the data state moves past them. ``chunk``: the steps per dispatch the caller
        runs, where it asks for fewer before a boundary (a placing thread builds chunks
        of that size ahead; by default ``steps``)."""
        if self.resident:
            return self._timed(self._resident, steps)
        return (None, *self._timed(self._host, steps, chunk or steps))

    def _timed(self, take: Callable[..., Any], *args: Any) -> Any:
        """``take(*args)``, its seconds counted as start-up (the first) or waiting."""
        if self._closed:
            raise RuntimeError(f"This {type(self).__name__} was closed.")
        began = time.perf_counter()
        try:
            return take(*args)
        except Exception as error:
            drop_grain_note(error)
            raise
        finally:
            seconds = time.perf_counter() - began
            if self._started:
                self.wait_seconds += seconds
            else:
                self.startup_seconds += seconds
                self._started = True

    def _resident(self, steps: int) -> tuple[Any, Any, int]:
        pipeline = self.pipeline
        assert isinstance(pipeline, TrainPipeline)
        resident = self._resident_data()
        assert resident is not None
        offset = self.step - self._block_start
        if self._block is None or offset < 0 or offset + steps > self._block_steps:
            self._block_start, offset = self.step, 0
            indices = pipeline.chunk_indices(self.step, self._block_steps)
            if jax.process_count() == 1:  # a transfer every few hundred steps: no program
                self._block = jax.device_put(indices, stacked_sharding(resident.index_sharding))
            else:
                self._block = place_stacked_rows(
                    indices, resident.index_sharding, pipeline.global_batch_size
                )
        self.step += steps
        return resident.arrays, self._block, offset

    def _open(self, chunk: int = 1) -> Iterator[Any]:
        """The pipeline's iterator, and the placing thread where there is one: for chunks it
        reads and places whole chunks (of ``chunk`` steps first), else one batch at a time."""
        if self._local is None:
            self._local = iter(self.pipeline.local_batches(self.step))
            if self._stacked:
                self._rows = _Rows(self._local, chunk)
            if self.in_thread:
                # Nothing the thread runs refers to the feed, so a feed dropped unclosed
                # is collected and its finalizer ends the thread.
                if self._rows is not None:
                    self._ahead = PlacedAhead(
                        self._rows, functools.partial(_placed_chunk, self.pipeline), ahead=2
                    )
                else:
                    self._ahead = PlacedAhead(
                        self._local,
                        functools.partial(_place, self.pipeline, stacked=False),
                        ahead=max(self.prefetch, 1),
                    )
                weakref.finalize(self, self._ahead.stop)
        return self._local

    def _host(self, steps: int, chunk: int) -> tuple[Any, int]:
        """``(xs, offset)`` from host batches stacked in chunks of ``chunk`` steps (by the
        placing thread, ahead, or here): the rest of the chunk under way, or the next
        one where it fits; else (the chunk size changed, or a boundary left part of a
        chunk) a chunk built here from the same batches. Each chunk is one transfer, and
        the steps before a boundary come from a chunk of the size the loop runs, so
        their program is the chunk's."""
        self._open(chunk)
        rows, ahead = self._rows, self._ahead
        assert rows is not None
        rows.size = chunk  # the next chunks
        placed = self._chunk
        if placed is None or len(placed.rows) - placed.used < steps:
            left = [] if placed is None else placed.rows[placed.used :]
            placed = None
            if not left and not (ahead is not None and ahead.finished and rows.front):
                # The thread's error, if any, comes after the chunks before it.
                placed = next(ahead) if ahead else _placed_chunk(self.pipeline, next(rows))
                if not steps <= len(placed.rows) <= max(chunk, steps):
                    left, placed = placed.rows, None
            self._chunk = placed = placed or self._rebuilt(left, steps)
        offset = placed.used
        placed.used += steps
        self.step += steps
        return placed.xs, offset

    def _rebuilt(self, first: list[Any], steps: int) -> _PlacedChunk:
        """A chunk of ``steps`` batches placed in this thread: ``first``, then those a
        placing thread placed ahead (it waits meanwhile), then new ones; the batches
        left over go back in front of the next chunks, so the order stays the
        pipeline's."""
        rows, ahead = self._rows, self._ahead
        assert rows is not None
        with ahead.held() if ahead is not None else contextlib.nullcontext([]) as ready:
            batches = first + [b for placed in ready for b in placed.rows] + list(rows.front)
            rows.front.clear()
            try:
                while len(batches) < steps:
                    if ahead is not None and ahead.finished:  # its error or the end, in turn
                        next(ahead)
                    batches.append(next(rows.local))
            finally:
                rows.front.extend(batches[steps:] if len(batches) >= steps else batches)
        return _placed_chunk(self.pipeline, batches[:steps])

    def _one(self) -> Any:
        """The next placed batch as it is (``GlobalBatchIterator``; ``StopIteration`` at the
        end of a finite pipeline)."""
        local = self._open()
        if self._ahead is not None:
            placed = next(self._ahead)  # the thread's error, after the batches before it
            self.step += 1
            return placed
        while len(self._placed) <= self.prefetch and not self._exhausted:
            try:
                batch = next(local)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as error:
                if not self._placed:
                    raise
                self._error, self._exhausted = error, True  # the batches before it come first
                break
            self._placed.append(_place(self.pipeline, batch, stacked=False))
        if not self._placed:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration
        self.step += 1
        return self._placed.popleft()

    def state(self) -> dict[str, Any]:
        """The JSON-able data state to checkpoint beside the model."""
        return {"step": self.step, **self.pipeline.state_fields()}

    def describe(self) -> str:
        """How input reaches the devices, for a run's summary."""
        resident = self._resident_data()
        if resident is not None:
            return resident.describe()
        return "host, placed by a thread" if self.in_thread else "host"

    def close(self) -> None:
        """Releases the placed batches, the placing thread and the pipeline's iterator."""
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
        self._rows = self._chunk = None
        self._block = None


class GlobalBatchIterator(Feed, Iterator[dict[str, jax.Array]]):
    """Iterates global ``jax.Array`` batches, each placed on the devices ``prefetch`` steps early.

    The one-step face of ``Feed`` for loops of one's own and for evaluation. Each
    process-local batch from the pipeline becomes a global array with
    ``meshkit.shard_batch`` (no cross-process communication). Who places it follows
    the pipeline's ``InputSettings.placement``: on a CPU (``'auto'``) the caller's
    thread, queued asynchronously like a step, so the host-to-device copies of the
    next ``prefetch`` batches overlap the steps already queued; on a GPU or TPU a
    thread of its own that keeps ``prefetch`` batches placed, so the caller only takes
    them. (Per-example work runs in the pipeline's own threads or worker processes.)
    ``state()`` is a small JSON-able dict (step, seed, shuffle, global batch size,
    source fingerprint) for checkpoints; passing it back as ``state=`` resumes at that
    step, and is refused if the seed, shuffle setting, batch size or data differ.

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
        super().__init__(pipeline, state, stacked=False, prefetch=prefetch)

    def __next__(self) -> dict[str, jax.Array]:
        return self._timed(self._one)

    def __iter__(self) -> GlobalBatchIterator:
        return self

    def __len__(self) -> int:
        """Batches left, for finite pipelines."""
        total = self.pipeline.num_steps
        if total is None:
            raise TypeError("An endless training pipeline has no length; pass num_epochs.")
        return total - self.step

    def __enter__(self) -> GlobalBatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _place(pipeline: TrainPipeline | EvalPipeline, *batches: Any, stacked: bool) -> Any:
    """Host batches placed in one transfer: one as it is, or several stacked on a step axis."""
    if not stacked:
        (batch,) = batches
        return place_local_rows(batch, pipeline.sharding, pipeline.global_batch_size)
    if len(batches) == 1:
        stack = {key: np.asarray(value)[None] for key, value in batches[0].items()}
    else:
        stack = {key: np.stack([b[key] for b in batches]) for key in batches[0]}
    return place_stacked_rows(stack, pipeline.sharding, pipeline.global_batch_size)


@dataclasses.dataclass
class _PlacedChunk:
    """Host batches and their stack on the devices (a leading step axis); ``used`` of
    them taken."""

    rows: list[Any]
    xs: Any
    used: int = 0


def _placed_chunk(pipeline: TrainPipeline | EvalPipeline, rows: list[Any]) -> _PlacedChunk:
    return _PlacedChunk(rows, _place(pipeline, *rows, stacked=True))


class _Rows(Iterator[list[Any]]):
    """Host input's chunks (a placing thread's, or the loop's): lists of ``size`` host
    batches (fewer at the end), the batches put back in ``front`` first, then the
    pipeline's."""

    def __init__(self, local: Iterator[Any], size: int):
        self.local = local
        self.front: collections.deque[Any] = collections.deque()
        self.size = size

    def __next__(self) -> list[Any]:
        rows: list[Any] = []
        while len(rows) < self.size:
            if self.front:
                rows.append(self.front.popleft())
                continue
            try:
                rows.append(next(self.local))
            except StopIteration:
                break
        if not rows:
            raise StopIteration
        return rows

    def close(self) -> None:
        close = getattr(self.local, "close", None)
        if close is not None:
            close()


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
