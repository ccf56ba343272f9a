"""Global batches from a pipeline: sharded onto the mesh ahead of time, with a resumable state."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from meshkit._batch import shard_batch
from meshkit.data._pipeline import EvalPipeline, TrainPipeline

_DONE = object()


class GlobalBatchIterator(Iterator[dict[str, jax.Array]]):
    """Iterates global ``jax.Array`` batches; a background thread keeps ``prefetch`` ready.

    Each process-local batch from the pipeline becomes a global array with
    ``meshkit.shard_batch`` (no cross-process communication). ``state()`` is a small
    JSON-able dict (step, seed, global batch size, source fingerprint) for
    checkpoints; passing it back as ``state=`` resumes at that step, and is refused
    if the seed, batch size or data differ.

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
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 batch, got {prefetch}.")
        self.pipeline = pipeline
        self._step = 0 if state is None else check_state(pipeline, state)
        self.wait_seconds = 0.0
        """Time ``next()`` spent waiting for a batch: input-bound time of the consumer."""
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="meshkit-batches", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        pipeline = self.pipeline
        try:
            for local in pipeline.dataset(self._step):
                batch = shard_batch(
                    local, pipeline.sharding, global_batch_size=pipeline.global_batch_size
                )
                if not self._put(batch):
                    return
        except BaseException as error:  # surfaced in the consumer's thread
            self._put(error)
            return
        self._put(_DONE)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> dict[str, jax.Array]:
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _next(self) -> dict[str, jax.Array]:
        while True:
            if self._stop.is_set():
                raise RuntimeError("This GlobalBatchIterator was closed.")
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if item is _DONE:
            self._queue.put(_DONE)  # later calls stop too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._step += 1
        return item

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
        """Stops the background thread."""
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> GlobalBatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_state(pipeline: TrainPipeline | EvalPipeline, state: Mapping[str, Any]) -> int:
    """Validates a saved data state against ``pipeline``; returns the step to resume at."""
    expected = pipeline.state_fields()
    missing = sorted({"step", *expected} - set(state))
    if missing:
        raise ValueError(
            f"The data state {dict(state)} lacks {missing}; it was not saved by meshkit."
        )
    differ = {key: (state[key], value) for key, value in expected.items() if state[key] != value}
    if differ:
        details = "; ".join(
            f"{key}: saved {saved!r}, now {now!r}" for key, (saved, now) in differ.items()
        )
        raise ValueError(
            f"Cannot resume: the saved data state does not match this pipeline ({details}). "
            "Resuming would feed different batches than the interrupted run. Use the same "
            "seed, global batch size and data, or start from a fresh work directory."
        )
    step = state["step"]
    total = pipeline.num_steps
    if not isinstance(step, int) or step < 0 or (total is not None and step > total):
        raise ValueError(f"The saved step {step!r} is outside this pipeline's [0, {total}] steps.")
    return step
