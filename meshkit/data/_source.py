"""Random-access data sources: the protocol and the in-memory ``ArraySource``."""

from __future__ import annotations

import hashlib
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from meshkit._pytree import leading_rows
from meshkit.data._labels import LABEL_FIELD, check_label_options, check_labels

Record = dict[str, np.ndarray]
"""One example: field name -> array (``{"image": uint8[28, 28, 1], "label": int32[]}``)."""


def stack_records(records: Sequence[Record]) -> Record:
    """Stacks records field by field: a list of examples becomes one batch."""
    return {key: np.stack([record[key] for record in records]) for key in records[0]}


@runtime_checkable
class Source(Protocol):
    """What meshkit's pipelines read: a length, random access, and a fingerprint.

    ``fingerprint`` identifies the data (not the object): checkpoints store it so a
    run cannot silently resume on different data.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Record: ...

    @property
    def fingerprint(self) -> str: ...


def source_fingerprint(source: object) -> str:
    """``source.fingerprint`` if it has one, else its type and length."""
    fingerprint = getattr(source, "fingerprint", None)
    if isinstance(fingerprint, str):
        return fingerprint
    return f"{type(source).__name__}:{len(source)}"  # type: ignore[arg-type]


class ArraySource:
    """A source over in-memory arrays that share their leading (example) dimension.

    A field named ``"label"`` holds class indices and is checked here, once: its dtype
    must be an integer one and its values non-negative, and below ``num_classes`` when
    that is given (a label of -1 would otherwise train as the last class, and one of
    ``num_classes`` or more would give NaN losses).

    Args:
        arrays: Field name -> array, one row per example.
        name: Names the data in the fingerprint, ``repr`` and error messages.
        num_classes: The number of classes, when known: labels must lie in
            ``[0, num_classes)``. Kept as ``source.num_classes`` (and written to an
            ArrayRecord sidecar by :func:`write_array_record`).
        ignore_label: A label value admitted besides the classes (e.g. ``-1`` for
            unlabelled examples); it must not be a class itself. meshkit's built-in
            losses do not skip it: a loss of your own must mask it.

    Raises:
        ValueError: No arrays, different leading dimensions, or a bad ``"label"``
            field; the message names the value, its index and the fix.

    Examples:
        >>> import numpy as np
        >>> source = ArraySource({"x": np.arange(6).reshape(3, 2), "y": np.arange(3)})
        >>> len(source), source[1]["x"].tolist(), int(source[1]["y"])
        (3, [2, 3], 1)
        >>> try:
        ...     ArraySource({"label": np.array([0, 1, 10])}, num_classes=10)
        ... except ValueError as error:
        ...     print(str(error).split(" (")[0])
        ArraySource 'arrays': label 10 at index 2 is outside the classes [0, 10)
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        name: str = "arrays",
        num_classes: int | None = None,
        ignore_label: int | None = None,
    ):
        if not arrays:
            raise ValueError("ArraySource needs at least one array, got none.")
        self.arrays = {key: np.asarray(value) for key, value in arrays.items()}
        self._length = leading_rows(self.arrays, what="ArraySource")
        self.name = name
        where = f"ArraySource {name!r}"
        self.num_classes, self.ignore_label = check_label_options(
            num_classes, ignore_label, where=where
        )
        if LABEL_FIELD in self.arrays:
            check_labels(
                self.arrays[LABEL_FIELD],
                where=where,
                num_classes=self.num_classes,
                ignore_label=self.ignore_label,
            )
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Record:
        return {key: value[index] for key, value in self.arrays.items()}

    def getitems(self, indices: np.ndarray) -> Record:
        """A batch of examples at once (fancy indexing; what pipelines call)."""
        return {key: value[indices] for key, value in self.arrays.items()}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}: {v.dtype}{list(v.shape[1:])}" for k, v in self.arrays.items())
        return f"ArraySource({self.name}, {self._length} examples, {fields})"

    @property
    def fingerprint(self) -> str:
        """A SHA-1 over the arrays' names, dtypes, shapes and bytes (computed once)."""
        if self._fingerprint is None:
            digest = hashlib.sha1()
            for key in sorted(self.arrays):
                value = np.ascontiguousarray(self.arrays[key])
                digest.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
                digest.update(value.data)
            self._fingerprint = f"{self.name}:{digest.hexdigest()[:16]}"
        return self._fingerprint


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip
_NPY_MAGIC = b"\x93NUMPY"
_NPZ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)
"""What numpy and zipfile raise for a damaged archive or member (``OSError`` covers
``BadZipFile``'s CRC checks on older Pythons, ``zlib.error`` a damaged deflate stream)."""

_REWRITE = "write it again with np.savez (or copy it again, if it came from elsewhere)"


def _check_npz_magic(path: Path) -> None:
    """Refuses a file that is not a zip archive, before numpy guesses what it holds.

    Without this, ``np.load`` returns a bare array for a ``.npy`` file and tries to
    unpickle any other bytes (refused, with a message about pickles).
    """
    with path.open("rb") as file:
        head = file.read(len(_NPY_MAGIC))
    if head.startswith(_ZIP_MAGIC):
        return
    if head.startswith(_NPY_MAGIC):
        raise ValueError(
            f"{path} is a .npy file (one unnamed array, written by np.save); load_npz reads "
            ".npz archives of named arrays. Save it with np.savez(path, name=array), or wrap "
            "the array yourself: ArraySource({'name': np.load(path)})."
        )
    found = "is empty" if not head else f"starts with {head!r}"
    raise ValueError(
        f"{path} is not an .npz archive: it {found}, expected a zip archive "
        f"(b'PK\\x03\\x04') written by np.savez. It is truncated or in another format; "
        f"{_REWRITE}."
    )


def _error_name(error: Exception) -> str:
    """``ValueError``, ``zipfile.BadZipFile``, ``zlib.error``: the type, with its module."""
    kind = type(error)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _npz_error(path: Path, error: Exception, name: str | None = None) -> ValueError:
    """The error for an archive (or its array ``name``) that numpy cannot read."""
    what = f"array {name!r} of {path}" if name is not None else f"{path} as an .npz archive"
    found = f"{_error_name(error)}: {error}"
    if "allow_pickle" in str(error):  # numpy's refusal of an object (pickled) array
        return ValueError(
            f"Cannot read {what} ({found}): it holds pickled Python objects, which load_npz "
            "refuses (loading them can run code). Save numeric arrays with np.savez."
        )
    return ValueError(
        f"Cannot read {what} ({found}): the file is damaged or truncated; {_REWRITE}."
    )


def _read_npz(path: Path, keys: tuple[str, ...] | None) -> dict[str, np.ndarray]:
    """The arrays ``keys`` (all by default) of the ``.npz`` file ``path``, as numpy arrays."""
    _check_npz_magic(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except _NPZ_ERRORS as error:
        raise _npz_error(path, error) from None
    with archive:
        held = list(archive.files)
        names = held if keys is None else list(keys)
        missing = [name for name in names if name not in held]
        if missing:
            raise ValueError(
                f"{path} has no arrays {missing}; it holds {held}. Pick keys= from those."
            )
        arrays = {}
        for name in names:
            try:
                array = archive[name]
            except _NPZ_ERRORS as error:
                raise _npz_error(path, error, name) from None
            if not isinstance(array, np.ndarray):  # numpy returns other zip members as bytes
                raise ValueError(
                    f"{path} holds {name!r}, which is not a .npy array: the file is a zip "
                    "archive but not one written by np.savez. Save the arrays with np.savez."
                )
            arrays[name] = array
    return arrays


def load_npz(
    path: str | Path,
    *,
    keys: tuple[str, ...] | None = None,
    num_classes: int | None = None,
    ignore_label: int | None = None,
) -> ArraySource:
    """An ``ArraySource`` over the arrays of an ``.npz`` file (all of them, or ``keys``).

    An array named ``"label"`` is checked as :class:`ArraySource` does. Every error
    names the file (and the array, when one member is damaged) and the fix: a ``.npy``
    file, an empty, truncated or damaged archive, or pickled object arrays are refused
    with a ``ValueError``, never numpy's or zipfile's own ``BadZipFile``, ``EOFError``
    or ``TypeError``.

    Args:
        path: A file written by ``np.savez`` or ``np.savez_compressed`` (pickled
            object arrays are refused).
        keys: The arrays to read; all of them by default.
        num_classes: The number of classes, when known: labels must lie in
            ``[0, num_classes)``.
        ignore_label: A label value admitted besides the classes (e.g. ``-1``).

    Raises:
        FileNotFoundError: No file at ``path``.
        ValueError: The file is not an ``.npz`` archive or is damaged, lacks ``keys``,
            or its labels are not integer class indices.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "d.npz")
        >>> np.savez(path, image=np.zeros((4, 2, 2)), label=np.arange(4))
        >>> len(load_npz(path, num_classes=4))
        4
        >>> np.save(path.replace(".npz", ".npy"), np.zeros(3))
        >>> try:
        ...     load_npz(path.replace(".npz", ".npy"))
        ... except ValueError as error:
        ...     print(str(error).split(" (")[0].split("/")[-1])
        d.npy is a .npy file
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No .npz file at {path}; pass the path of a file written by np.savez."
        )
    arrays = _read_npz(path, keys)
    num_classes, ignore_label = check_label_options(num_classes, ignore_label, where=str(path))
    if LABEL_FIELD in arrays:
        check_labels(
            arrays[LABEL_FIELD], where=str(path), num_classes=num_classes, ignore_label=ignore_label
        )
    return ArraySource(arrays, name=path.name, num_classes=num_classes, ignore_label=ignore_label)
