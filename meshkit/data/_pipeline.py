"""Training and evaluation pipelines on ``grain.MapDataset``: exact, resumable, layout-free.

Both pipelines describe a stream of *global* batches and let each process build only
its rows of each one (``meshkit.data_shard``). Global batch ``k`` is the same set of
examples, in the same order, whatever the number of processes or devices, because
everything random (the epoch order, augmentation) is keyed by the example's global
position, never by a process's local counters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np
from jax.sharding import NamedSharding

from meshkit._batch import DataShard, data_shard, pad_rows
from meshkit._checks import check_int
from meshkit.data._generators import generators
from meshkit.data._input import InputSettings, checked_settings
from meshkit.data._labels import check_labels
from meshkit.data._resident import (
    ResidentData,
    ResidentMode,
    check_eval_fits,
    choose_layout,
    eval_batches_bytes,
    place_eval_batches,
    place_resident,
    read_all,
)
from meshkit.data._source import Record, Source, source_fingerprint, stack_records

Transform = Callable[[Record, np.random.Generator], Record]
"""Per-example map: ``(record, rng) -> record``; ``rng`` is seeded by the example's
global position, so augmentation does not depend on the process layout."""

EvalTransform = Callable[[Record], Record]
"""Deterministic per-example map for evaluation."""

_UNBOUNDED_STEPS = 2**62
_SHUFFLE, _AUGMENT = 0, 1  # domain tags: the two random streams never alias


def _check_common(source: Any, global_batch_size: int, sharding: NamedSharding) -> DataShard:
    if not isinstance(source, Source):
        raise TypeError(
            f"Expected a data source with __len__, __getitem__ and fingerprint, got "
            f"{type(source).__name__}. Wrap arrays with meshkit.data.ArraySource."
        )
    return data_shard(sharding, global_batch_size)


def _fetch(source: Source, indices: np.ndarray) -> Record:
    getitems = getattr(source, "getitems", None)
    if getitems is not None:
        return getitems(indices)
    return stack_records([source[int(i)] for i in indices])


class _Pipeline:
    """What both pipelines share: the source, this process's rows, and Grain's read options."""

    num_steps: int | None

    def __init__(
        self,
        source: Source,
        global_batch_size: int,
        sharding: NamedSharding,
        *,
        transform: object | None,
        settings: InputSettings,
    ):
        self.shard = _check_common(source, global_batch_size, sharding)
        self.source = source
        self._source_length = len(source)  # the steps, orders and padding derive from it
        self.global_batch_size = global_batch_size
        self.sharding = sharding
        # In-memory arrays without a transform are gathered a whole batch at a time
        # (one numpy call); anything else is read and transformed one example at a time,
        # so Grain's threads and workers spread the examples, not only the batches.
        self.per_example = transform is not None or getattr(source, "getitems", None) is None
        # A transform with a ``batch`` method builds whole batches (vectorised work after
        # the per-example decode): threads and workers then take whole batches too.
        self.batched = callable(getattr(transform, "batch", None))
        # What this process does to a batch its worker processes built (a batched
        # transform's ``finish``, in a TrainPipeline); ``None``: nothing.
        self._finish: Callable[[Record], Record] | None = None
        self.input_settings = settings
        # A gather is one numpy call: threads only add their start-up time. Work per
        # example gets two threads.
        default_threads = 2 if self.per_example else 0
        self.num_threads = default_threads if settings.num_threads is None else settings.num_threads
        self.prefetch = settings.prefetch
        self.worker_count = settings.worker_count

    @functools.cached_property
    def fingerprint(self) -> str:
        """The source's fingerprint, computed when a data state first needs it."""
        return source_fingerprint(self.source)

    def _check_source_length(self) -> None:
        """Raises if the source's length changed since the pipeline was built.

        The number of steps, the epoch orders and the evaluation mask all derive from
        the length at construction: with a grown source they would silently skip the
        new examples, with a shrunk one index past its end. Checked at the start of
        every pass and before every batch (one ``len()`` call).
        """
        length = len(self.source)
        if length != self._source_length:
            raise ValueError(
                f"The source of this {type(self).__name__} had {self._source_length} examples "
                f"when the pipeline was built and has {length} now ({self.source!r}). Its "
                "steps were planned for the old length, so it would skip "
                "examples or read past the end. Keep the source fixed while a pipeline "
                "reads it, or build a new pipeline over the source as it is now."
            )

    def local_batch(self, step: int) -> Record:
        """This process's rows of global batch ``step``."""
        self._check_source_length()
        if not self.per_example:
            return self._gathered_batch(step)
        size = self.shard.size
        return stack_records([self.example(step * size + row) for row in range(size)])

    def example(self, position: int) -> Record:
        """Example ``position`` of this process's stream, read and transformed.

        Position ``p`` is row ``p % shard.size`` of this process's part of global batch
        ``p // shard.size``; everything random about it is keyed by its global position,
        so it is the same example, transformed the same way, on any process layout and
        with any number of threads or workers.
        """
        raise NotImplementedError

    def _gathered_batch(self, step: int) -> Record:
        raise NotImplementedError

    def dataset(self, start_step: int = 0) -> grain.IterDataset:
        raise NotImplementedError

    def local_batches(self, start_step: int = 0) -> Iterator[Record]:
        """This process's batches from ``start_step`` on, as a plain iterator.

        Without threads or workers to spread the work over, the batches are built in
        the caller's thread, one ``local_batch`` call each: the same batches Grain's
        sequential read gives, without its per-element bookkeeping. Otherwise this is
        ``iter(dataset(start_step))``.
        """
        if self.num_threads or self.worker_count:
            return iter(self.dataset(start_step))
        return map(self.local_batch, self._steps(start_step))

    def _steps(self, start_step: int) -> range:
        """Steps ``start_step`` to the end (or practically forever, for endless training)."""
        self._check_source_length()
        stop = self.num_steps if self.num_steps is not None else _UNBOUNDED_STEPS
        if not 0 <= start_step <= stop:
            raise ValueError(f"start_step must be in [0, {stop}], got {start_step}.")
        return range(start_step, stop)

    def _unfinished_batch(self, step: int) -> Record:
        """What a worker process builds of batch ``step`` (``_finish`` does the rest)."""
        return self.local_batch(step)

    def _batches(self, steps: range) -> grain.IterDataset:
        """The batches of ``steps``, built ahead by threads (or worker processes).

        Per-example pipelines on threads map over examples and batch afterwards, so the
        threads read and transform examples in parallel. Otherwise each element is a
        whole ``local_batch``: one gather for in-memory arrays, or, in Grain's worker
        processes (each takes whole elements of the dataset it is given), a batch that
        one worker builds from its examples one by one.
        """
        prefetch = self.prefetch if self.num_threads else 0
        if not self.per_example or self.worker_count > 0 or self.batched:
            finish = self._finish if self.worker_count > 0 else None
            build = self.local_batch if finish is None else self._unfinished_batch
            batches = grain.MapDataset.range(steps.start, steps.stop).map(build)
            read = grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=prefetch)
            built = self._in_workers(batches.to_iter_dataset(read))
            return built if finish is None else built.map(finish)
        size = self.shard.size
        examples = grain.MapDataset.range(
            steps.start * size, min(steps.stop * size, _UNBOUNDED_STEPS)
        ).map(self.example)
        read = grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=prefetch * size)
        return examples.to_iter_dataset(read).batch(
            size, drop_remainder=True, batch_fn=stack_records
        )

    def _in_workers(self, iterable: grain.IterDataset) -> grain.IterDataset:
        if self.worker_count == 0:
            return iterable
        _mark_absl_flags_parsed()
        # Each worker keeps ``prefetch`` batches ready (Grain's default is 1: a worker
        # then waits for its one batch to be taken before it builds the next).
        options = grain.MultiprocessingOptions(
            num_workers=self.worker_count, per_worker_buffer_size=max(1, self.prefetch)
        )
        return iterable.mp_prefetch(options)

    def __getstate__(self) -> dict[str, Any]:
        # Pipelines travel to Grain worker processes without their sharding or resident
        # arrays: devices don't pickle, and workers only build host batches.
        state = {**self.__dict__, "sharding": None}
        state.pop("resident_data", None)
        state.pop("resident_batches", None)
        return state


class TrainPipeline(_Pipeline):
    """An endless (or ``num_epochs``-long) stream of training batches, this process's rows.

    Every epoch visits the examples in a new order, drawn from ``(seed, epoch)`` so
    no two pairs share an order; the ``len(source) % global_batch_size`` examples
    left at the end of an epoch are dropped on every process alike, so every process
    runs the same number of steps. Each process reads and transforms only its own rows,
    one example at a time (Grain's threads or workers spread the examples), and
    ``transform`` gets an RNG keyed by ``(seed, epoch, global position)``: the batches do
    not depend on the number of processes, threads or workers.

    The data state (``state_fields``) records the seed, ``shuffle``, the global batch
    size and the source's fingerprint, so a resume with any of them changed is
    refused. The source must keep its length while the pipeline reads it: the epoch
    orders are drawn for the length at construction, and a batch built after the
    length changed raises a ``ValueError`` naming both lengths.

    Args:
      source: a ``Source`` (``ArraySource``, ``digits(...)``, file readers...).
      global_batch_size: examples per global batch, a multiple of the data shards.
      sharding: the batch sharding (``meshkit.batch_sharding(mesh)``).
      seed: the shuffle and augmentation seed.
      transform: optional ``(record, rng) -> record`` augmentation.
      num_epochs: stop after this many epochs; ``None`` repeats forever.
      shuffle: ``False`` keeps the source order (for debugging and tests).
      input_settings: how batches are built and where the data lives
        (``InputSettings``: threads, workers, prefetch, resident, placement), never which examples
        they hold. With ``InputSettings(resident=True)`` the whole dataset is placed on
        the devices once and ``fit`` gathers each batch there by index. That needs an
        in-memory source, or a ``transform`` that draws nothing (its ``deterministic``
        attribute is true, as ``decode_transform()``'s is), which then runs once over
        every example when the data is placed; augment in the step
        (``device_augmentation(...).wrap``). ``resident_data`` says where it went.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit.data import ArraySource, TrainPipeline
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> source = ArraySource({"x": np.arange(100), "y": np.arange(100) % 10})
        >>> pipeline = TrainPipeline(source, global_batch_size=32,
        ...                          sharding=meshkit.batch_sharding(mesh), num_epochs=2)
        >>> pipeline.steps_per_epoch, pipeline.num_steps
        (3, 6)
        >>> batch = next(iter(pipeline.dataset()))
        >>> batch["x"].shape
        (32,)
    """

    def __init__(
        self,
        source: Source,
        *,
        global_batch_size: int,
        sharding: NamedSharding,
        seed: int = 0,
        transform: Transform | None = None,
        num_epochs: int | None = None,
        shuffle: bool = True,
        input_settings: InputSettings | None = None,
    ):
        settings = checked_settings(type(self).__name__, input_settings)
        super().__init__(
            source, global_batch_size, sharding, transform=transform, settings=settings
        )
        if len(source) < global_batch_size:
            raise ValueError(
                f"The source has {len(source)} examples, fewer than one global batch of "
                f"{global_batch_size}; use a smaller batch size (training drops the "
                "remainder of every epoch)."
            )
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}.")
        self.seed = check_int(seed, name="seed", minimum=0)
        self.transform = transform
        self._finish = getattr(transform, "finish", None) if self.batched else None
        if not isinstance(shuffle, bool | np.bool_):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}.")
        self.shuffle = bool(shuffle)  # a plain bool: it goes into the JSON data state
        self.steps_per_epoch = self._source_length // global_batch_size
        self.num_steps = None if num_epochs is None else num_epochs * self.steps_per_epoch
        self.resident_mode: ResidentMode | None
        self.resident_mode, self.resident_bytes = self._resident_layout(settings.resident)

    def _resident_layout(self, resident: bool | ResidentMode) -> tuple[ResidentMode | None, int]:
        """The resident layout and bytes per device (``(None, 0)``: host input); checked
        when the pipeline is built, so a dataset that cannot be resident is refused
        before anything compiles."""
        if resident is False:  # else True, "replicated" or "sharded" (InputSettings checks)
            return None, 0
        once = self.transform is not None and getattr(self.transform, "deterministic", False)
        if self.transform is not None and not once:
            name = getattr(self.transform, "__name__", type(self.transform).__name__)
            raise ValueError(
                f"resident={resident!r} gathers batches on the devices, where the random "
                f"host transform {name} cannot run. Pass a transform that draws nothing "
                "(decode_transform(), run once when the data is placed) or none, augment in "
                "the step with meshkit.data.image.device_augmentation(...).wrap(loss_fn), or "
                "keep resident=False."
            )
        if (
            not once
            and not isinstance(getattr(self.source, "arrays", None), dict)
            and not callable(getattr(self.source, "getitems", None))
        ):
            raise ValueError(
                f"resident={resident!r} needs an in-memory source whose examples can be read "
                f"all at once (ArraySource, digits, mnist, cifar10...), got {self.source!r}. Load "
                "the arrays into an ArraySource, pass a decoding transform (decode_transform(), "
                "run once over every record), or keep resident=False."
            )
        mode = None if resident is True else resident
        return choose_layout(  # for a transform: one example transformed, the rest later
            self._source_length,
            self._placed_example(0) if once else self.source[0],
            self.sharding,
            mode=mode,
            what=repr(self.source),
        )

    def _placed_example(self, index: int) -> Record:
        """Source example ``index`` as a resident dataset stores it: through the
        deterministic transform, when there is one."""
        record = self.source[index]
        if self.transform is None:
            return record
        try:
            return self.transform(record, None)  # pyright: ignore[reportArgumentType]
        except Exception as error:
            error.add_note(
                f"[meshkit] while the transform {type(self.transform).__name__} read source "
                f"index {index} of {self.source!r}, to place the dataset on the devices"
            )
            raise

    def _source_arrays(self) -> Record:
        """Every example of the source, field by field (for resident data); a
        deterministic transform runs here, once per example."""
        if self.transform is not None:
            return read_all(self._source_length, self._placed_example, what=repr(self.source))
        arrays = getattr(self.source, "arrays", None)
        if isinstance(arrays, dict):
            return arrays
        return _fetch(self.source, np.arange(self._source_length))

    @functools.cached_property
    def resident_data(self) -> ResidentData | None:
        """The dataset on the devices (placed the first time this is read), or ``None``
        for host input."""
        if self.resident_mode is None:
            return None
        self._check_source_length()
        return place_resident(
            self._source_arrays(),
            self.sharding,
            self.resident_mode,
            bytes_per_device=self.resident_bytes,
        )

    def chunk_indices(self, start_step: int, steps: int) -> np.ndarray:
        """Source indices of global batches ``start_step .. start_step + steps - 1``:
        ``int32[steps, rows, ...]``, this process's rows (or every row, for a dataset
        whose rows are split over the devices: each device looks for all of them)."""
        self._check_source_length()
        rows = slice(None) if self.resident_mode == "sharded" else self.shard.slice
        return np.stack(
            [self.global_indices(step)[rows] for step in range(start_step, start_step + steps)]
        ).astype(np.int32)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - the pipeline lives as long as its cache
    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which ``epoch`` visits the source's examples."""
        if not self.shuffle:
            return np.arange(self._source_length)
        rng = np.random.default_rng([self.seed, _SHUFFLE, epoch])
        return rng.permutation(self._source_length)

    def global_indices(self, step: int) -> np.ndarray:
        """Source indices of global batch ``step``, in row order."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        return self.epoch_order(epoch)[start : start + self.global_batch_size]

    def _gathered_batch(self, step: int) -> Record:
        return _fetch(self.source, self.global_indices(step)[self.shard.slice])

    def example(self, position: int) -> Record:
        self._check_source_length()
        record, rng = self._read(position)
        if self.transform is None:
            return record
        try:
            out = self.transform(record, rng)  # pyright: ignore[reportArgumentType]
        except Exception as error:
            error.add_note(self._where_transform_failed(position))
            raise
        if "label" in out:
            self._check_transformed_labels(out["label"], [position])
        return out

    def local_batch(self, step: int) -> Record:
        if not self.batched:
            return super().local_batch(step)
        batch = self._unfinished_batch(step)
        return batch if self._finish is None else self._finish(batch)

    def _unfinished_batch(self, step: int) -> Record:
        """This process's rows of global batch ``step`` from a batched transform,
        before its ``finish``."""
        self._check_source_length()
        size = self.shard.size
        records, rngs = self._read_batch(step)
        build_batch: Callable[..., Record] = getattr(self.transform, "batch")  # noqa: B009
        try:
            batch = build_batch(records, rngs)
        except Exception:
            # Find the example that fails, one at a time (only on this failure path).
            for row, (record, rng) in enumerate(zip(records, rngs, strict=True)):
                try:
                    self.transform(record, rng)  # pyright: ignore[reportOptionalCall]
                except Exception as error:
                    error.add_note(self._where_transform_failed(step * size + row))
                    raise
            raise
        if "label" in batch:
            self._check_transformed_labels(batch["label"], [step * size + r for r in range(size)])
        return batch

    def _check_transformed_labels(self, labels: Any, positions: list[int]) -> None:
        """The source checks its labels; a transform may map them out of the classes.
        ``positions`` are the examples' positions in this stream (one per label row)."""
        array = np.asarray(labels)
        bound = getattr(self.source, "num_classes", None)
        if array.size and array.min() >= 0 and (bound is None or array.max() < bound):
            return  # the usual case: one min and one max
        check_labels(
            array if array.ndim else array[None],
            where=f"{type(self.source).__name__} after the transform "
            f"{type(self.transform).__name__}",
            num_classes=bound,
            ignore_label=getattr(self.source, "ignore_label", None),
            indices=np.asarray([self._source_index(position) for position in positions]),
            item="source index",
        )

    def _where_transform_failed(self, position: int) -> str:
        """The note added to a transform's error: which example, stored where."""
        index = self._source_index(position)
        locate = getattr(self.source, "locate", None)
        stored = f"{locate(index)}, " if callable(locate) else ""
        return (
            f"[meshkit] while the transform {type(self.transform).__name__} read {stored}"
            f"source index {index} of {self.source!r}"
        )

    def _locate(self, position: int) -> tuple[int, int, int]:
        """``(epoch, global position, source index)`` of the example at ``position`` of
        this stream."""
        step, row = divmod(position, self.shard.size)
        epoch, within = divmod(step, self.steps_per_epoch)
        global_position = within * self.global_batch_size + self.shard.start + row
        return epoch, global_position, int(self.epoch_order(epoch)[global_position])

    def _source_index(self, position: int) -> int:
        """The source index of the example at ``position`` of this stream."""
        return self._locate(position)[2]

    def _read(self, position: int) -> tuple[Record, np.random.Generator | None]:
        """The source record at ``position`` of this stream and its augmentation generator."""
        epoch, global_position, index = self._locate(position)
        record = self.source[index]
        if self.transform is None:
            return record, None
        return record, np.random.default_rng([*self._augmentation_entropy(epoch), global_position])

    def _augmentation_entropy(self, epoch: int) -> list[int]:
        """The entropy of ``epoch``'s augmentation generators, less the example's global
        position that ends it: the same for any number of processes, workers or threads.
        (One generator is built by numpy itself; a batch's together, with ``generators``,
        whose array operations cost about as much as numpy's hashing of 10 generators.)"""
        return [self.seed, _AUGMENT, epoch]

    def _read_batch(self, step: int) -> tuple[list[Record], list[np.random.Generator]]:
        """This stream's records of ``step`` and their augmentation generators (as
        ``_read``, built together), read and checked together where the source can
        (``examples``)."""
        size = self.shard.size
        located = [self._locate(position) for position in range(step * size, (step + 1) * size)]
        indices = [index for _, _, index in located]
        read_examples: Callable[[list[int]], list[Record]] | None = getattr(
            self.source, "examples", None
        )
        records = (
            read_examples(indices)
            if read_examples is not None
            else [self.source[index] for index in indices]
        )
        epoch = located[0][0]  # a step's rows all lie in its epoch
        positions = [position for _, position, _ in located]
        return records, generators(self._augmentation_entropy(epoch), positions)

    def dataset(self, start_step: int = 0) -> grain.IterDataset:
        """This process's batches from ``start_step`` on, built ahead by threads.

        Resuming is slicing: the batches from ``start_step`` equal those an
        uninterrupted run would see from there, for any number of processes or
        workers. With ``worker_count > 0`` batches are built in Grain worker processes
        (spawned: the script needs an ``if __name__ == "__main__":`` guard; absl flags
        that nobody parsed are marked as parsed, which Grain's workers need). On small
        machines threads are usually faster.
        """
        return self._batches(self._steps(start_step))

    def state_fields(self) -> dict[str, Any]:
        """What a checkpoint must match to resume this pipeline."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "fingerprint": self.fingerprint,
        }


class EvalPipeline(_Pipeline):
    """One pass over the source, padded to whole global batches with a mask.

    Every example appears exactly once globally. Global batch ``k`` holds examples
    ``k * global_batch_size`` onwards; rows past the end are padding: ``mask`` is
    ``False``, ``index`` is ``-1`` and the fields are zeros. ``num_steps`` is known up
    front from the example count, so every process runs the same number of steps.

    That count is the source's length when the pipeline is built. A source that grows
    or shrinks afterwards is refused at the start of the next pass (and before each
    batch) with a ``ValueError`` naming both lengths, rather than evaluated short or
    past its end: build a new ``EvalPipeline`` over the source as it is now.

    ``InputSettings(resident=True)`` runs ``transform`` once over every example and
    places the padded batches on the devices (``resident_batches``: ``[num_steps,
    global_batch_size, ...]``, each batch's rows where a host batch's would be);
    ``full_eval`` then slices each batch there and sends nothing per step. The bytes
    per device (``resident_bytes``) are checked against the resident limit when the
    pipeline is built (``MESHKIT_RESIDENT_BYTES``; see ``TrainPipeline``).

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit.data import ArraySource, EvalPipeline
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> source = ArraySource({"x": np.arange(10.0)})
        >>> pipeline = EvalPipeline(source, global_batch_size=8,
        ...                         sharding=meshkit.batch_sharding(mesh))
        >>> pipeline.num_steps
        2
        >>> last = list(pipeline.dataset())[-1]
        >>> last["index"].tolist()
        [8, 9, -1, -1, -1, -1, -1, -1]
    """

    def __init__(
        self,
        source: Source,
        *,
        global_batch_size: int,
        sharding: NamedSharding,
        transform: EvalTransform | None = None,
        input_settings: InputSettings | None = None,
    ):
        settings = checked_settings(type(self).__name__, input_settings)
        super().__init__(
            source, global_batch_size, sharding, transform=transform, settings=settings
        )
        self.transform = transform
        self.num_examples = self._source_length
        self.num_steps = math.ceil(self.num_examples / global_batch_size)
        if not isinstance(settings.resident, bool):
            raise TypeError(
                "An EvalPipeline's InputSettings(resident=...) must be True or False (its "
                f"padded batches are placed as they are), got {settings.resident!r}."
            )
        self.resident = settings.resident
        self.resident_bytes = 0
        if self.resident:  # checked now, so an evaluation set too large fails before training
            self.resident_bytes = eval_batches_bytes(
                self.num_steps, global_batch_size, self._template, sharding
            )
            check_eval_fits(self.resident_bytes, sharding, what=repr(source))

    @functools.cached_property
    def resident_batches(self) -> dict[str, Any]:
        """The padded batches on the devices, ``[num_steps, global_batch_size, ...]`` per
        field (placed, transformed once, the first time this is read); ``{}`` for host
        input. Each batch's rows sit where a host batch's would."""
        if not self.resident:
            return {}
        self._check_source_length()
        arrays = read_all(self.num_examples, self._record, what=repr(self.source))
        return place_eval_batches(arrays, self.sharding, self.global_batch_size)

    @functools.cached_property
    def _template(self) -> Record:
        return self._record(0)

    def _record(self, index: int) -> Record:
        record = self.source[index]
        return record if self.transform is None else self.transform(record)

    def _gathered_batch(self, step: int) -> Record:
        positions = step * self.global_batch_size + np.arange(self.shard.start, self.shard.stop)
        valid = positions < self.num_examples
        if valid.any():  # the real rows in one read
            batch, _ = pad_rows(_fetch(self.source, positions[valid]), len(positions))
        else:
            batch = {
                key: np.zeros((len(positions), *np.shape(value)), np.asarray(value).dtype)
                for key, value in self._template.items()
            }
        batch["mask"] = valid
        batch["index"] = np.where(valid, positions, -1).astype(np.int64)
        return batch

    def example(self, position: int) -> Record:
        self._check_source_length()
        step, row = divmod(position, self.shard.size)
        index = step * self.global_batch_size + self.shard.start + row
        valid = index < self.num_examples
        if valid:
            record = dict(self._record(index))
        else:
            record = {key: np.zeros_like(value) for key, value in self._template.items()}
        record["mask"] = np.asarray(valid)
        record["index"] = np.asarray(index if valid else -1, np.int64)
        return record

    def dataset(self, start_step: int = 0) -> grain.IterDataset:
        """This process's padded batches, ``num_steps`` of them."""
        return self._batches(self._steps(start_step))

    def state_fields(self) -> dict[str, Any]:
        """What a checkpoint must match to resume this pipeline."""
        return {"global_batch_size": self.global_batch_size, "fingerprint": self.fingerprint}


def _mark_absl_flags_parsed() -> None:
    """Grain's worker start-up reads absl flags; unparsed flags raise in a plain script.

    Programs that parse flags themselves (``absl.app.run``) are left alone.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
