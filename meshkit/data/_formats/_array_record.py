"""ArrayRecord files of fixed-shape examples: a writer for any source, and a reader.

Layout: one ArrayRecord record per example, holding the raw bytes of its fields
concatenated in a fixed order, and a JSON sidecar ``<path>.json`` naming the fields,
their dtypes and shapes, the number of records and, when the source knows them, its
``num_classes`` and ``ignore_label``. Records carry no pickles and no
per-record headers, so reading is ``np.frombuffer`` at known offsets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data._labels import LABEL_FIELD, check_label_dtype, check_label_options, check_labels
from meshkit.data._source import Record, Source, source_fingerprint

FORMAT = "meshkit.array_record.v1"
"""The ``format`` entry of every sidecar this module writes."""

IMAGE_RECORDS_FORMAT = "meshkit.image_records.v1"
"""The ``format`` of encoded image records' sidecars (``meshkit.data.image_records``)."""


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.name}: {self.dtype.str}{list(self.shape)}"


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of an ArrayRecord file: its path with ``.json`` appended.

    Examples:
        >>> sidecar_path("out/train.array_record").name
        'train.array_record.json'
    """
    path = Path(path)
    return path.with_name(path.name + ".json")


def error_reason(error: BaseException) -> str:
    """``"TypeName: message"`` for an error message's parenthesis (no colon if empty)."""
    return f"{type(error).__name__}: {error}".rstrip(": ")


def record_key(index: int, count: int) -> int:
    """``index`` (negative counts from the end) as a record key in ``[0, count)``."""
    key = int(index) + (count if index < 0 else 0)
    if not 0 <= key < count:
        raise IndexError(f"Index {index} is out of range for {count} records.")
    return key


def _fields_of(record: Record) -> list[_Field]:
    fields = []
    for name, value in record.items():
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise ValueError(
                f"Field {name!r} has dtype {array.dtype}; ArrayRecord files hold numeric or "
                "fixed-size string arrays only."
            )
        fields.append(_Field(str(name), array.dtype, tuple(array.shape)))
    return fields


def _encode(record: Record, fields: list[_Field], index: int) -> bytes:
    """The record's field bytes in ``fields`` order, after checking names, dtypes, shapes."""
    if sorted(record) != sorted(field.name for field in fields):
        raise ValueError(
            f"Example {index} has fields {sorted(record)}; example 0 had "
            f"{sorted(field.name for field in fields)}. All examples must share their fields."
        )
    parts = []
    for field in fields:
        array = np.asarray(record[field.name])
        if array.dtype != field.dtype or array.shape != field.shape:
            raise ValueError(
                f"Example {index} has {field.name!r} of {array.dtype.str}{list(array.shape)}; "
                f"example 0 had {field.dtype.str}{list(field.shape)}. ArrayRecord files "
                "written here need fixed shapes and dtypes."
            )
        parts.append(np.ascontiguousarray(array).tobytes())
    return b"".join(parts)


def _label_options(
    source: Source, first: Record, where: str
) -> tuple[int | None, int | None] | None:
    """The source's ``(num_classes, ignore_label)``, or ``None`` when it has no label field."""
    if LABEL_FIELD not in first:
        return None
    return check_label_options(
        getattr(source, "num_classes", None), getattr(source, "ignore_label", None), where=where
    )


def _check_written_label(
    record: Record, index: int, where: str, labels: tuple[int | None, int | None]
) -> None:
    """Checks example ``index``'s label before it is written."""
    num_classes, ignore_label = labels
    check_labels(
        np.asarray(record[LABEL_FIELD])[None],
        where=where,
        num_classes=num_classes,
        ignore_label=ignore_label,
        indices=np.array([index]),
        item="example",
    )


def _label_entries(labels: tuple[int | None, int | None] | None) -> dict[str, int]:
    """The sidecar entries ``num_classes`` and ``ignore_label``, those that are known."""
    if labels is None:
        return {}
    entries = dict(zip(("num_classes", "ignore_label"), labels, strict=True))
    return {name: value for name, value in entries.items() if value is not None}


def write_array_record(source: Source, path: str | Path) -> Path:
    """Writes every example of ``source`` to the ArrayRecord file ``path`` (+ sidecar).

    Each example becomes one record: its fields' raw bytes concatenated. All examples
    must share field names, dtypes and shapes (those of example 0). The file is written
    with ``group_size:1`` (fast random access) under a temporary name and renamed when
    complete; the sidecar ``path + ".json"`` is written last. A ``"label"`` field is
    checked as it is written (integer, non-negative, below ``source.num_classes`` when
    the source has one); the sidecar keeps the source's ``num_classes`` and
    ``ignore_label`` so that :class:`ArrayRecordSource` checks them on reading.

    Args:
        source: Any :class:`Source` with at least one example.
        path: The ArrayRecord file to write; missing parent folders are created.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: The source is empty, an example's fields differ from example 0's, or
            a label is not a class index.

    Examples:
        >>> import tempfile
        >>> from meshkit.data import digits
        >>> path = write_array_record(digits("test"), f"{tempfile.mkdtemp()}/test.array_record")
        >>> len(ArrayRecordSource(path))
        360
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    path = Path(path)
    count = len(source)
    if count < 1:
        raise ValueError(f"Cannot write {path}: the source has no examples.")
    first = source[0]
    fields = _fields_of(first)
    where = f"{type(source).__name__} written to {path}"
    labels = _label_options(source, first, where)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = ArrayRecordWriter(str(partial), "group_size:1")
    try:
        for index in range(count):
            record = source[index] if index else first
            data = _encode(record, fields, index)
            if labels is not None:
                _check_written_label(record, index, where, labels)
            writer.write(data)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    partial.replace(path)
    sidecar = {
        "format": FORMAT,
        "count": count,
        "fields": [{"name": f.name, "dtype": f.dtype.str, "shape": list(f.shape)} for f in fields],
        "source_fingerprint": source_fingerprint(source),
        **_label_entries(labels),
    }
    sidecar_path(path).write_text(json.dumps(sidecar, indent=1) + "\n")
    return path


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (``json`` keeps the last)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key(s) {twice} appear twice in one object")
    return dict(pairs)


def _check_unique_fields(path: Path, fields: list[_Field]) -> None:
    """Refuses a sidecar naming a field twice: the record would silently lose one of them."""
    names = [field.name for field in fields]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        listed = ", ".join(field.describe() for field in fields)
        raise ValueError(
            f"{path} names the field(s) {twice} more than once ({listed}); every field of a "
            "record needs its own name. Remove or rename the duplicates in its 'fields' "
            "(keeping their bytes in the order written), or rewrite the file with "
            "write_array_record."
        )


def _format_of(text: str) -> object:
    """The ``format`` entry of a sidecar, or ``None`` when it has none or is not JSON."""
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    return spec.get("format") if isinstance(spec, dict) else None


def _parse_sidecar(
    path: Path, text: str
) -> tuple[int, list[_Field], tuple[int | None, int | None]]:
    """The count, fields and ``(num_classes, ignore_label)`` of a sidecar.

    Raises a ``ValueError`` naming ``path`` if the sidecar is malformed.
    """
    if _format_of(text) == IMAGE_RECORDS_FORMAT:
        raise ValueError(
            f"{path} describes encoded image records, not fixed-shape examples; open them "
            "with meshkit.data.image_records(path)."
        )
    try:
        spec = json.loads(text, object_pairs_hook=_unique_keys)
        count = int(spec["count"])
        fields = [
            _Field(str(f["name"]), np.dtype(f["dtype"]), tuple(int(n) for n in f["shape"]))
            for f in spec["fields"]
        ]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f"{path} is not a valid sidecar ({type(error).__name__}: {error}); expected JSON "
            "with 'count' and 'fields' (name, dtype, shape) as written by write_array_record."
        ) from None
    _check_unique_fields(path, fields)
    if spec.get("format") != FORMAT or not fields:
        raise ValueError(
            f"{path} has format {spec.get('format')!r} and {len(fields)} fields; expected "
            f"format {FORMAT!r} and at least one field. Rewrite it with write_array_record."
        )
    labels = tuple(spec.get(key) for key in ("num_classes", "ignore_label"))
    if not all(value is None or type(value) is int for value in labels):
        raise ValueError(
            f"{path} has num_classes={labels[0]!r} and ignore_label={labels[1]!r}; expected "
            "integers or null. Fix them, or rewrite the sidecar with write_array_record."
        )
    num_classes, ignore_label = labels
    return count, fields, (num_classes, ignore_label)


def _preview(keys: Sequence[int], limit: int = 8) -> str:
    """``[3, 9, 12]``, or the first ``limit`` keys and how many more."""
    shown = ", ".join(map(str, keys[:limit]))
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return f"[{shown}{more}]"


class ArrayRecordSource:
    """Reads an ArrayRecord file written by :func:`write_array_record` (random access).

    Records are read with ``grain.sources.ArrayRecordDataSource`` and decoded with
    ``np.frombuffer`` into the fields the sidecar ``path + ".json"`` describes. Arrays
    returned by ``source[i]`` are read-only views of the record's bytes;
    ``getitems(indices)`` returns a stacked, writable batch.

    A ``"label"`` field must have an integer dtype (checked here) and each record's
    label is checked as it is decoded: non-negative, below ``num_classes`` when known,
    or equal to ``ignore_label``. Reading every record up front would cost a pass over
    the file, so a bad label raises when its record is first read, naming the record.

    Args:
        path: The ArrayRecord file; its sidecar must sit beside it.
        num_classes: The number of classes; by default the sidecar's ``num_classes``
            (written from the source's), else only negative labels are refused.
        ignore_label: A label value admitted besides the classes; by default the
            sidecar's ``ignore_label``.

    Raises:
        FileNotFoundError: The file or its sidecar is missing.
        ValueError: The sidecar is malformed, or disagrees with the file, or the label
            field is not of an integer dtype. Reading raises a ``ValueError`` for a
            record whose label is not a class.

    Examples:
        >>> import tempfile
        >>> from meshkit.data import synthetic
        >>> path = f"{tempfile.mkdtemp()}/synthetic.array_record"
        >>> source = ArrayRecordSource(write_array_record(synthetic(8, (4, 4, 3)), path))
        >>> len(source), source[3]["image"].shape, source.getitems([0, 5])["label"].shape
        (8, (4, 4, 3), (2,))
    """

    def __init__(
        self,
        path: str | Path,
        *,
        num_classes: int | None = None,
        ignore_label: int | None = None,
    ):
        import grain

        self.path = Path(path)
        sidecar = sidecar_path(self.path)
        for file, what in ((self.path, "ArrayRecord file"), (sidecar, "sidecar")):
            if not file.is_file():
                raise FileNotFoundError(
                    f"No {what} at {file}. Write the file and its sidecar with "
                    "meshkit.data.write_array_record or `python -m meshkit.data.convert`."
                )
        text = sidecar.read_text()
        self._count, self._fields, (saved_classes, saved_ignore) = _parse_sidecar(sidecar, text)
        self.num_classes, self.ignore_label = check_label_options(
            saved_classes if num_classes is None else num_classes,
            saved_ignore if ignore_label is None else ignore_label,
            where=str(self.path),
        )
        label = next((field for field in self._fields if field.name == LABEL_FIELD), None)
        if label is not None:
            check_label_dtype(label.dtype, where=str(sidecar))
        self._has_label = label is not None
        self._record_size = sum(field.nbytes for field in self._fields)
        try:
            self._records: Any = grain.sources.ArrayRecordDataSource(str(self.path))
        except Exception as error:  # the reader reports corrupt files in several ways
            reason = error_reason(error)
            raise ValueError(
                f"{self.path} is not a readable ArrayRecord file ({reason}): it is damaged or "
                "truncated. Write it again with meshkit.data.write_array_record or "
                "`python -m meshkit.data.convert` (or copy it again, if it came from elsewhere)."
            ) from None
        if len(self._records) != self._count:
            raise ValueError(
                f"{self.path} holds {len(self._records)} records but {sidecar} says "
                f"{self._count}; the two files do not belong together."
            )
        digest = hashlib.sha1(f"{text}|{self.path.stat().st_size}".encode())
        self._fingerprint = f"array_record:{self.path.name}:{digest.hexdigest()[:16]}"

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        fields = ", ".join(field.describe() for field in self._fields)
        return f"ArrayRecordSource({self.path}, {self._count} examples, {fields})"

    @property
    def fingerprint(self) -> str:
        """A hash of the sidecar's content and the file's size."""
        return self._fingerprint

    @property
    def fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Field name -> (dtype, shape of one example), as the sidecar describes them."""
        return {field.name: (field.dtype, field.shape) for field in self._fields}

    def _key(self, index: int) -> int:
        return record_key(index, self._count)

    def _read(self, keys: list[int]) -> list[bytes]:
        """The records ``keys`` (checked), or a ``ValueError`` naming a damaged one."""
        if not keys:
            return []
        try:
            if len(keys) == 1:
                return [self._records[keys[0]]]
            return list(self._records.__getitems__(keys))
        except Exception as error:  # the reader's checksums fail as RuntimeErrors
            raise self._damaged(keys, error) from None

    def _damaged(self, keys: list[int], error: Exception) -> ValueError:
        """The error for a failed read of ``keys``, naming the first record that fails alone.

        Only runs once a read has failed, so re-reading records one by one costs nothing
        in a healthy run.
        """
        bad = keys
        if len(keys) > 1:
            for key in keys:
                try:
                    self._records[key]
                except Exception as single:  # any failure locates the record
                    bad, error = [key], single
                    break
        where = f"Record {bad[0]}" if len(bad) == 1 else f"One of records {_preview(bad)}"
        reason = error_reason(error)
        return ValueError(
            f"{where} of {self.path} cannot be read ({reason}): the file is damaged or "
            "truncated. Write it again with meshkit.data.write_array_record or "
            "`python -m meshkit.data.convert` (or copy it again, if it came from elsewhere)."
        )

    def _check_size(self, record: bytes, key: int) -> None:
        if len(record) != self._record_size:
            fields = ", ".join(field.describe() for field in self._fields)
            raise ValueError(
                f"Record {key} of {self.path} has {len(record)} bytes; its sidecar describes "
                f"{self._record_size} bytes per record ({fields}). Rewrite the file."
            )

    def _check_labels(self, labels_K: np.ndarray, keys: Sequence[int]) -> None:
        """Checks the labels of records ``keys`` as they are decoded (a min and a max)."""
        check_labels(
            labels_K,
            where=str(self.path),
            num_classes=self.num_classes,
            ignore_label=self.ignore_label,
            indices=np.asarray(keys),
            item="record",
        )

    def __getitem__(self, index: int) -> Record:
        return self.examples([index])[0]

    def examples(self, indices: Sequence[int] | np.ndarray) -> list[Record]:
        """``[self[i] for i in indices]``, the labels checked together: how a pipeline
        with a per-example transform reads a batch's records (one read per record, as
        ``EncodedRecordSource.examples`` does)."""
        keys = [self._key(int(index)) for index in np.asarray(indices).reshape(-1)]
        examples = []
        for key in keys:
            (record,) = self._read([key])
            self._check_size(record, key)
            out, offset = {}, 0
            for field in self._fields:
                count = math.prod(field.shape)
                out[field.name] = np.frombuffer(record, field.dtype, count, offset).reshape(
                    field.shape
                )
                offset += field.nbytes
            examples.append(out)
        if self._has_label and examples:
            self._check_labels(np.stack([example[LABEL_FIELD] for example in examples]), keys)
        return examples

    def getitems(self, indices: Sequence[int] | np.ndarray) -> Record:
        """The examples at ``indices`` stacked into one batch per field (one batched read)."""
        keys = [self._key(int(index)) for index in np.asarray(indices).reshape(-1)]
        records = self._read(keys)
        for key, record in zip(keys, records, strict=True):
            self._check_size(record, key)
        bytes_KxB = np.frombuffer(b"".join(records), np.uint8).reshape(len(keys), self._record_size)
        out, offset = {}, 0
        for field in self._fields:
            column = np.ascontiguousarray(bytes_KxB[:, offset : offset + field.nbytes])
            out[field.name] = column.view(field.dtype).reshape(len(keys), *field.shape)
            offset += field.nbytes
        if self._has_label:
            self._check_labels(out[LABEL_FIELD], keys)
        return out
