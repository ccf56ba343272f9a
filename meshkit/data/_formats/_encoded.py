"""A source over ArrayRecord files of encoded records, decoded by a function of the user's.

Where :class:`~meshkit.data.ArrayRecordSource` reads meshkit's own fixed-shape layout,
:class:`EncodedRecordSource` reads any ArrayRecord file whose records are bytes in some
encoding (JPEG images in msgpack maps, ``tf.train.Example`` protos, JSON lines) and
hands each record's bytes to ``decode``. Records may differ in length and shape.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data._labels import LABEL_FIELD, check_label_options, check_labels

from ._array_record import error_reason, record_key

Decode = Callable[[bytes], dict[str, Any]]
"""Turns one record's bytes into an example: field name -> array (or ``bytes``)."""

_GLOB_CHARACTERS = frozenset("*?[")
_FULL_HASH_BYTES = 16 << 20
"""Files up to this size are hashed whole for the fingerprint; larger ones are sampled."""
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10

_REWRITE = (
    "Write it again (meshkit.data.write_image_records or `python -m meshkit.data.convert`), "
    "or copy it again if it came from elsewhere."
)


def _expand(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files ``paths`` names (``~`` expanded, glob patterns sorted), in the order given."""
    given = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not given:
        raise ValueError("EncodedRecordSource needs at least one path; got an empty list.")
    files: list[Path] = []
    for path in given:
        text = os.path.expanduser(os.fspath(path))  # noqa: PTH111 (a pattern, not a Path)
        if _GLOB_CHARACTERS & set(text) and not Path(text).exists():
            matches = sorted(glob.glob(text))  # noqa: PTH207 (absolute patterns)
            if not matches:
                raise FileNotFoundError(
                    f"The pattern {text!r} matches no file. Check the folder and the shard "
                    "names (e.g. 'train.array_record-*')."
                )
            files.extend(Path(match) for match in matches)
        else:
            files.append(Path(text))
    missing = [str(file) for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(
            f"No ArrayRecord file at {missing}. Write the records with "
            "meshkit.data.write_image_records or `python -m meshkit.data.convert`."
        )
    return files


def _count_records(path: Path) -> int:
    """The number of records of ``path``, or a ``ValueError`` if it cannot be opened."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(path))
        try:
            return int(reader.num_records())
        finally:
            reader.close()
    except Exception as error:  # the reader reports damaged files in several ways
        raise ValueError(
            f"{path} is not a readable ArrayRecord file ({error_reason(error)}): it is damaged, "
            f"truncated or in another format. {_REWRITE}"
        ) from None


def _file_digest(path: Path) -> str:
    """SHA-1 of the whole file up to 16 MiB; else of its size and 16 evenly spaced 64 KiB blocks.

    A sampled digest misses a change that keeps the file's size and lies outside the
    sampled blocks; ArrayRecord's index (at the end, sampled) changes with any record's
    length.
    """
    size = path.stat().st_size
    digest = hashlib.sha1(f"{size};".encode())
    with path.open("rb") as file:
        if size <= _FULL_HASH_BYTES:
            digest.update(file.read())
        else:
            for block in range(_SAMPLES):
                file.seek((size - _SAMPLE_BYTES) * block // (_SAMPLES - 1))
                digest.update(file.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _callable_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


class EncodedRecordSource:
    """Random access to ArrayRecord records of any encoding, decoded by ``decode``.

    One file or many (shards, in the order given; a glob pattern expands to its sorted
    matches) form one source: index ``i`` counts across the files, so shards
    ``a-00000-of-00003, a-00001-of-00003, ...`` read like the unsharded file. Every
    file is opened once here to count its records; reads use
    ``grain.sources.ArrayRecordDataSource``, which opens its readers when first read,
    and again after the source is unpickled (Grain worker processes get a copy that
    opens its own readers). ``decode`` must therefore be picklable for workers: a
    module-level function, not a lambda.

    A field named ``"label"`` in the decoded example is checked as it is read
    (non-negative, below ``num_classes`` when known, or ``ignore_label``).

    Args:
        paths: An ArrayRecord file, a glob pattern, or a sequence of them.
        decode: Turns one record's bytes into an example (field name -> array, or
            ``bytes`` for data a transform decodes later). It may raise anything: the
            error is re-raised as a ``ValueError`` naming the record and the file.
        num_classes: The number of classes of a ``"label"`` field, when known
            (``len(class_names)`` by default).
        ignore_label: A label value admitted besides the classes.
        class_names: The name of each class, when known.

    Raises:
        FileNotFoundError: A file is missing or a pattern matches nothing.
        ValueError: A file is not a readable ArrayRecord file, or the files hold no
            records.

    Examples:
        >>> import json, tempfile
        >>> from array_record.python.array_record_module import ArrayRecordWriter
        >>> path = f"{tempfile.mkdtemp()}/lines.array_record"
        >>> writer = ArrayRecordWriter(path, "group_size:1")
        >>> for n in (3, 1, 4):
        ...     writer.write(json.dumps({"x": list(range(n))}).encode())
        >>> writer.close()
        >>> def decode(data):
        ...     return {"x": np.asarray(json.loads(data)["x"], np.int32)}
        >>> source = EncodedRecordSource(path, decode=decode)
        >>> len(source), source[2]["x"].tolist()
        (3, [0, 1, 2, 3])
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        decode: Decode,
        num_classes: int | None = None,
        ignore_label: int | None = None,
        class_names: Sequence[str] | None = None,
    ):
        import grain

        if not callable(decode):
            raise TypeError(
                f"decode must be a function from a record's bytes to a dict of arrays; got "
                f"{decode!r} ({type(decode).__name__})."
            )
        self.paths = tuple(_expand(paths))
        self.decode = decode
        if class_names is not None:
            class_names = tuple(str(name) for name in class_names)
            if num_classes is not None and len(class_names) != num_classes:
                raise ValueError(
                    f"{len(class_names)} class_names for num_classes={num_classes}; pass "
                    "one name per class."
                )
            num_classes = len(class_names)
        self.class_names: tuple[str, ...] | None = class_names
        self.num_classes, self.ignore_label = check_label_options(
            num_classes, ignore_label, where=f"EncodedRecordSource({self.paths[0]})"
        )
        counts = [_count_records(path) for path in self.paths]
        self._offsets = np.cumsum([0, *counts])
        if self._offsets[-1] == 0:
            raise ValueError(
                f"{[str(path) for path in self.paths]} hold no records; expected at least one."
            )
        # "file[start:end]" tells the reader each file's length, so it opens none here.
        ranges = [f"{path}[0:{count}]" for path, count in zip(self.paths, counts, strict=True)]
        self._records: Any = grain.sources.ArrayRecordDataSource(ranges)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __repr__(self) -> str:
        files = str(self.paths[0]) if len(self.paths) == 1 else f"{len(self.paths)} files"
        decode = _callable_name(self.decode)
        classes = f", {self.num_classes} classes" if self.num_classes is not None else ""
        return f"EncodedRecordSource({files}, {len(self)} records{classes}, decode={decode})"

    def __getstate__(self) -> dict[str, Any]:
        """The source for a Grain worker process; refuses a ``decode`` that cannot travel."""
        try:
            pickle.dumps(self.decode)
        except Exception as error:  # pickling fails with several types
            raise TypeError(
                f"EncodedRecordSource cannot be sent to worker processes: its decode "
                f"{_callable_name(self.decode)} cannot be pickled ({error_reason(error)}). "
                "Define decode as a function at module level (not a lambda or a nested "
                "function), or use threads (worker_count=0)."
            ) from None
        return self.__dict__

    @property
    def fingerprint(self) -> str:
        """A hash of the files' names, record counts and bytes, and of ``decode``'s name.

        Files up to 16 MiB are hashed whole; larger ones by their size and 16 evenly
        spaced blocks of 64 KiB (computed once, when first asked for).
        """
        if self._fingerprint is None:
            digest = hashlib.sha1(_callable_name(self.decode).encode())
            for index, path in enumerate(self.paths):
                count = self._offsets[index + 1] - self._offsets[index]
                digest.update(f"|{path.name}:{count}:{_file_digest(path)}".encode())
            self._fingerprint = f"encoded_records:{self.paths[0].name}:{digest.hexdigest()[:16]}"
        return self._fingerprint

    def locate(self, index: int) -> str:
        """Where example ``index`` is stored: ``"Record 7 of a.array_record"`` (for messages)."""
        return self._locate(self._key(index))

    def _locate(self, key: int) -> str:
        """``"record 7 of b.array_record (record 1 of that file)"``, or without the part."""
        file = int(np.searchsorted(self._offsets, key, side="right")) - 1
        path = self.paths[file]
        if len(self.paths) == 1:
            return f"Record {key} of {path}"
        return f"Record {key} ({path}, its record {key - int(self._offsets[file])})"

    def _where(self, key: int) -> str:
        """The file holding record ``key``, for label messages (which name ``key``)."""
        if len(self.paths) == 1:
            return str(self.paths[0])
        file = int(np.searchsorted(self._offsets, key, side="right")) - 1
        return f"{self.paths[file]} (records counted across all {len(self.paths)} files)"

    def _key(self, index: int) -> int:
        return record_key(index, len(self))

    def record_bytes(self, index: int) -> bytes:
        """The raw bytes of record ``index`` (before ``decode``)."""
        key = self._key(index)
        try:
            return self._records[key]
        except Exception as error:  # the reader's checksums fail as RuntimeErrors
            raise ValueError(
                f"{self._locate(key)} cannot be read ({error_reason(error)}): the file is damaged "
                f"or truncated. {_REWRITE}"
            ) from None

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples([index])[0]

    def examples(self, indices: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """``[self[i] for i in indices]``, the labels checked together: how a pipeline
        with a per-example transform reads a batch's records.

        Raises:
          ValueError: a record cannot be read or decoded, or its label is out of range;
            the message names the record.
        """
        keys = [self._key(int(index)) for index in np.asarray(indices).reshape(-1)]
        # One read per record: for shuffled keys the reader's batched read (a thread pool
        # per call) costs more than it saves.
        records = [self.record_bytes(key) for key in keys]
        examples = [self._decoded(key, data) for key, data in zip(keys, records, strict=True)]
        if examples and LABEL_FIELD in examples[0]:
            self._check_labels([np.asarray(e[LABEL_FIELD]) for e in examples], keys)
        return examples

    def _check_labels(self, labels: list[np.ndarray], keys: list[int]) -> None:
        """Checks records ``keys``' labels: at once where they stack, and one record at a
        time to name the file of a bad one."""
        if len({label.shape for label in labels}) == 1:
            try:
                self._check_label_rows(np.stack(labels), keys)
                return
            except ValueError:
                pass  # a bad label: found again below, with its own file
        for label, key in zip(labels, keys, strict=True):
            self._check_label_rows(label[None], [key])

    def _check_label_rows(self, labels_N: np.ndarray, keys: list[int]) -> None:
        check_labels(
            labels_N,
            where=self._where(keys[0]),
            num_classes=self.num_classes,
            ignore_label=self.ignore_label,
            indices=np.asarray(keys),
            item="record",
        )

    def _decoded(self, key: int, data: bytes) -> dict[str, Any]:
        """``decode(data)`` for record ``key``: a dict, or an error naming the record."""
        try:
            example = self.decode(data)
        except Exception as error:  # decode is the user's: any failure names the record
            raise ValueError(
                f"{self._locate(key)} cannot be decoded by {_callable_name(self.decode)} "
                f"({error_reason(error)}; the record has {len(data)} bytes, starting "
                f"{data[:16]!r}). Check that decode matches how the file was written; if "
                f"it does, the record is damaged. {_REWRITE}"
            ) from None
        if not isinstance(example, dict):
            raise ValueError(
                f"{self._locate(key)}: {_callable_name(self.decode)} returned "
                f"{type(example).__name__}; expected a dict of field name -> array."
            )
        return example
