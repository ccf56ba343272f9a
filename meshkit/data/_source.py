"""Random-access data sources: the protocol and the in-memory ``ArraySource``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from meshkit._pytree import leading_rows

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

    Examples:
        >>> import numpy as np
        >>> source = ArraySource({"x": np.arange(6).reshape(3, 2), "y": np.arange(3)})
        >>> len(source), source[1]["x"].tolist(), int(source[1]["y"])
        (3, [2, 3], 1)
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], *, name: str = "arrays"):
        if not arrays:
            raise ValueError("ArraySource needs at least one array, got none.")
        self.arrays = {key: np.asarray(value) for key, value in arrays.items()}
        self._length = leading_rows(self.arrays, what="ArraySource")
        self.name = name
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


def load_npz(path: str | Path, *, keys: tuple[str, ...] | None = None) -> ArraySource:
    """An ``ArraySource`` over the arrays of an ``.npz`` file (all of them, or ``keys``).

    Examples:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "d.npz")
        >>> np.savez(path, image=np.zeros((4, 2, 2)), label=np.arange(4))
        >>> len(load_npz(path))
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
    return ArraySource(arrays, name=path.name)
