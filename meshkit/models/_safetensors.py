"""Regions of the tensors in a safetensors file, read with bounded host memory.

The format: eight bytes, the little-endian length of a JSON header; the header, naming
each tensor's dtype, shape and byte range in the data that follows (row-major). A
region is read with positioned reads (no memory map, whose touched pages would stay
resident as long as the file is open): the rows of the tensor's first dimension it
spans, straight into the result where it takes whole rows, else in blocks of at most
``BLOCK_BYTES`` from which its columns are copied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

BLOCK_BYTES = 2**18
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


def spans(region: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each dimension's ``(start, stop)`` of ``region`` (slices of step 1) in ``shape``."""
    return [s.indices(n)[:2] for s, n in zip(region, shape, strict=True)]


@dataclasses.dataclass(frozen=True)
class Tensor:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


class SafetensorsFile:
    """One safetensors file, open for reading regions of its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_header(self) -> dict[str, Tensor]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._damaged(f"{size} bytes, shorter than the header's length")
        length = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if length > size - 8:
            raise self._damaged(f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except ValueError as error:
            raise self._damaged(f"its header is not JSON: {error}") from None
        header.pop("__metadata__", None)
        tensors = {}
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise self._damaged(f"tensor {name!r} has dtype {entry.get('dtype')!r}")
            dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
                raise self._damaged(
                    f"tensor {name!r} ({entry['dtype']} {list(shape)}) is bytes {begin}-{end} "
                    f"of data that ends at {size - 8 - length}"
                )
            tensors[name] = Tensor(dtype, shape, 8 + length + begin)
        return tensors

    def _damaged(self, why: str) -> ValueError:
        return ValueError(
            f"{self.path} cannot be read as safetensors ({why}): the file is damaged or "
            "incomplete; download it again."
        )

    def read(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        """The part ``region`` (one slice of step 1 per dimension) of tensor ``name``."""
        tensor = self.tensors[name]
        if not tensor.shape:
            return self._read_into(np.empty((), tensor.dtype), tensor.offset)
        bounds = spans(region, tensor.shape)
        (first, last), inner = bounds[0], bounds[1:]
        row = tensor.shape[1:]
        row_bytes = math.prod(row) * tensor.dtype.itemsize
        whole_rows = all(b == (0, n) for b, n in zip(inner, row, strict=True))
        out = np.empty([stop - start for start, stop in bounds], tensor.dtype)
        if whole_rows:
            return self._read_into(out, tensor.offset + first * row_bytes)
        columns = (slice(None), *(slice(*b) for b in inner))
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        block = np.empty((min(step, last - first), *row), tensor.dtype)
        for start in range(first, last, step):
            rows = block[: min(step, last - start)]
            self._read_into(rows, tensor.offset + start * row_bytes)
            out[start - first : start - first + len(rows)] = rows[columns]
        return out

    def _read_into(self, out: np.ndarray, offset: int) -> np.ndarray:
        view = out.reshape(-1).view(np.uint8).data  # a memoryview of its bytes
        done = 0
        while done < len(view):
            read = os.preadv(self._fd, [view[done:]], offset + done)
            if read == 0:
                raise self._damaged("it ends inside a tensor")
            done += read
        return out

    def close(self) -> None:
        os.close(self._fd)
