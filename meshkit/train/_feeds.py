"""Where a chunk of steps gets its input: batches from the host, or indices into resident data.

Both feeds hand ``fit``'s chunk program ``(data, xs)``: ``xs`` has one leading entry
per step (a stacked batch, or the batch's source indices) and ``batch_of(data, x)``
turns one entry into the step's batch inside the program. Both keep the data state a
checkpoint records (the same as ``GlobalBatchIterator``'s, so a run saved with one
feed resumes with the other) and the seconds spent waiting for input.
"""

from __future__ import annotations

import functools
import itertools
import queue
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from meshkit._batch import place_stacked_rows, stacked_sharding
from meshkit.data import TrainPipeline
from meshkit.data._ahead import PlacedAhead, places_in_thread
from meshkit.data._iterator import check_state


def whole_batch(data: Any, x: Any) -> Any:
    """``batch_of`` for host input: the entry is the batch."""
    del data
    return x


class _Feed:
    """The step counter, data state and input timings both feeds share."""

    def __init__(self, pipeline: TrainPipeline, state: Mapping[str, Any] | None):
        self.pipeline = pipeline
        self.step = 0 if state is None else check_state(pipeline, state)
        self.wait_seconds = 0.0
        """Time spent building and placing chunks' input, after the first."""
        self.startup_seconds = 0.0
        """Time the first chunk's input took (resident data: placing the dataset)."""
        self._started = False

    def next_chunk(self, steps: int) -> tuple[Any, Any]:
        """``(data, xs)`` for the next ``steps`` steps; the data state moves past them."""
        began = time.perf_counter()
        try:
            out = self._chunk(steps)
            self.step += steps
            return out
        finally:
            seconds = time.perf_counter() - began
            if self._started:
                self.wait_seconds += seconds
            else:
                self.startup_seconds += seconds
                self._started = True

    def _chunk(self, steps: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The JSON-able data state to checkpoint beside the model."""
        return {"step": self.step, **self.pipeline.state_fields()}

    def close(self) -> None:
        """Releases what the feed holds."""


class HostChunks(_Feed):
    """Chunks of host batches: ``steps`` of this process's batches, on the devices stacked.

    Placed by the loop (``steps`` batches stacked on the host, one transfer), or by a
    placing thread (``InputSettings.placement``; on GPUs and TPUs by default) that
    builds and places the next two chunks the same way while the loop dispatches. It
    builds the sizes the feed orders: the next chunk is expected to be as long as the
    last one asked for; where the loop asks for another size (around a checkpoint,
    while ``'auto'`` measures), placed chunks are cut or joined on the devices once,
    and the next orders realign the chunks with the loop's.
    """

    batch_of = staticmethod(whole_batch)

    def __init__(self, pipeline: TrainPipeline, state: Mapping[str, Any] | None = None):
        super().__init__(pipeline, state)
        self._local: Iterator[Any] | None = None
        self.in_thread = places_in_thread(pipeline.input_settings.placement, pipeline.sharding)
        self._ahead: PlacedAhead[Any] | None = None
        self._orders: queue.Queue[int | None] = queue.Queue()  # chunk sizes for the thread
        self._ordered = 0  # steps ordered from the thread and not yet handed to the loop
        self._rest: tuple[Any, int] | None = None  # a placed chunk, and its first step not taken

    def _chunk(self, steps: int) -> tuple[Any, Any]:
        if self._local is None:
            self._local = iter(self.pipeline.local_batches(self.step))
            if self.in_thread:
                # Nothing the thread runs refers to the feed, so a feed dropped unclosed
                # is collected and its finalizer ends the thread.
                self._ahead = PlacedAhead(
                    _ordered_chunks(self._local, self._orders),
                    functools.partial(_placed, self.pipeline),
                    ahead=4,
                )
                weakref.finalize(self, _stop, self._ahead, self._orders)  # dropped unclosed
        if self._ahead is None:
            return None, _placed(self.pipeline, [next(self._local) for _ in range(steps)])
        if self._ordered < steps:  # the thread's chunks fall short of this one: complete it
            self._order(steps - self._ordered)
        pieces: list[Any] = []
        have = 0
        while have < steps:
            if self._rest is None:
                self._rest = (next(self._ahead), 0)
            chunk, start = self._rest
            length = _steps_in(chunk)
            take = min(length - start, steps - have)
            have += take
            if take == length:
                pieces.append(chunk)
            else:  # a window of the chunk: one compile per chunk length and window size
                pieces.append(_window(self.pipeline.sharding, take)(chunk, np.int32(start)))
            self._rest = None if start + take == length else (chunk, start + take)
        self._ordered -= steps
        # The next two chunks are expected to be this long; a first, shorter order
        # completes the steps already ordered to a whole one, realigning the thread's.
        while self._ordered < 2 * steps:
            self._order(steps - self._ordered % steps)
        return None, pieces[0] if len(pieces) == 1 else _joined(self.pipeline.sharding)(*pieces)

    def _order(self, size: int) -> None:
        self._orders.put(size)
        self._ordered += size

    def describe(self) -> str:
        """How input reaches the devices, for a run's summary."""
        return "host, placed by a thread" if self.in_thread else "host"

    def close(self) -> None:
        if self._ahead is not None:
            self._orders.put(None)  # a thread waiting for an order ends
            self._ahead.close()  # stops the thread, then closes the pipeline's iterator
        else:
            close = getattr(self._local, "close", None)
            if close is not None:
                close()
        self._ahead = None
        self._local = None
        self._rest = None


def _ordered_chunks(local: Iterator[Any], orders: queue.Queue[int | None]) -> Iterator[list[Any]]:
    """The batches of each chunk ordered (in the placing thread), until ``None``."""
    while (size := orders.get()) is not None:
        batches = list(itertools.islice(local, size))
        if not batches:
            return
        yield batches


def _placed(pipeline: TrainPipeline, batches: list[Any]) -> Any:
    """Batches stacked on the host and placed in one transfer."""
    if len(batches) == 1:
        stacked = {key: np.asarray(value)[None] for key, value in batches[0].items()}
    else:
        stacked = {key: np.stack([b[key] for b in batches]) for key in batches[0]}
    return place_stacked_rows(stacked, pipeline.sharding, pipeline.global_batch_size)


def _stop(ahead: PlacedAhead[Any], orders: queue.Queue[int | None]) -> None:
    """Ends a placing thread without waiting for it."""
    orders.put(None)  # a thread waiting for an order ends
    ahead.stop()


def _steps_in(chunk: Any) -> int:
    """The steps a placed chunk holds."""
    return jax.tree.leaves(chunk)[0].shape[0]


@functools.lru_cache(maxsize=64)
def _window(sharding: NamedSharding, steps: int) -> Any:
    """``steps`` steps of a placed chunk from step ``start`` on, on the devices."""
    return jax.jit(
        lambda chunk, start: jax.tree.map(
            lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, start, steps), chunk
        ),
        out_shardings=stacked_sharding(sharding),
    )


@functools.lru_cache(maxsize=16)
def _joined(sharding: NamedSharding) -> Any:
    """Placed chunks joined into one on the devices (no communication: the step axis is
    whole on every device)."""
    return jax.jit(
        lambda *chunks: jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *chunks),
        out_shardings=stacked_sharding(sharding),
    )


class ResidentChunks(_Feed):
    """Chunks of source indices into the dataset the pipeline placed on the devices."""

    def __init__(self, pipeline: TrainPipeline, state: Mapping[str, Any] | None = None):
        super().__init__(pipeline, state)
        resident = pipeline.resident_data  # placed now: timed as the feed's start-up
        assert resident is not None
        self.resident = resident
        self.batch_of = resident.gather

    def _chunk(self, steps: int) -> tuple[Any, Any]:
        indices = self.pipeline.chunk_indices(self.step, steps)
        placed = place_stacked_rows(
            indices, self.resident.index_sharding, self.pipeline.global_batch_size
        )
        return self.resident.arrays, placed

    def describe(self) -> str:
        """How input reaches the devices, for a run's summary."""
        return self.resident.describe()
