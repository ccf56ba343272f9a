"""Random-access data sources: the protocol and the in-memory ``ArraySource``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from meshkit._pytree import leading_rows
from meshkit.data._labels import LABEL_FIELD, check_label_options, check_labels

Record = dict[str, np.ndarray]
"""One example: field name -> array (``{"image": uint8[28, 28, 1], "label": int32[]}``)."""


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


def load_npz(
    path: str | Path,
    *,
    keys: tuple[str, ...] | None = None,
    num_classes: int | None = None,
    ignore_label: int | None = None,
) -> ArraySource:
    """An ``ArraySource`` over the arrays of an ``.npz`` file (all of them, or ``keys``).

    An array named ``"label"`` is checked as :class:`ArraySource` does; errors name the
    file.

    Args:
        path: A file written by ``np.savez`` (pickled object arrays are refused).
        keys: The arrays to read; all of them by default.
        num_classes: The number of classes, when known: labels must lie in
            ``[0, num_classes)``.
        ignore_label: A label value admitted besides the classes (e.g. ``-1``).

    Raises:
        FileNotFoundError: No file at ``path``.
        ValueError: The file is not an ``.npz`` archive, lacks ``keys``, or its labels
            are not integer class indices.

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "d.npz")
        >>> np.savez(path, image=np.zeros((4, 2, 2)), label=np.arange(4))
        >>> len(load_npz(path, num_classes=4))
        4
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No .npz file at {path}; pass the path of a file written by np.savez."
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            names = list(data.files) if keys is None else list(keys)
            missing = [name for name in names if name not in data.files]
            if missing:
                raise ValueError(f"{path} has no arrays {missing}; it holds {data.files}.")
            arrays = {name: data[name] for name in names}
    except (OSError, ValueError) as error:
        if isinstance(error, ValueError) and "has no arrays" in str(error):
            raise
        raise ValueError(f"Cannot read {path} as an .npz archive: {error}") from None
    num_classes, ignore_label = check_label_options(num_classes, ignore_label, where=str(path))
    if LABEL_FIELD in arrays:
        check_labels(
            arrays[LABEL_FIELD], where=str(path), num_classes=num_classes, ignore_label=ignore_label
        )
    return ArraySource(arrays, name=path.name, num_classes=num_classes, ignore_label=ignore_label)
