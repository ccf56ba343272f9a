"""Small files in the real MNIST IDX and CIFAR pickle formats, for tests and rehearsals.

The content is random; the layout (magic numbers, headers, pickle keys, file names) is
what the official files use, so meshkit's readers and the recipes' ``--data-dir`` can be
exercised without the datasets.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

CifarBatch = dict[bytes, object]
"""One CIFAR pickle's content: ``b"data"`` and label lists under bytes keys."""


def write_idx(path: Path, array: np.ndarray, magic: int | None = None) -> Path:
    """Writes ``array`` (uint8) as an IDX file, gzipped when ``path`` ends in ``.gz``."""
    magic = (2051 if array.ndim == 3 else 2049) if magic is None else magic
    header = struct.pack(">i", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + np.ascontiguousarray(array, np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def write_mnist(
    folder: Path,
    num_train: int = 5,
    num_test: int = 3,
    *,
    suffix: str = "",
    dotted: bool = False,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four MNIST files with random content; returns {split: (images, labels)}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, prefix, n in (("train", "train", num_train), ("test", "t10k", num_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        sep = "." if dotted else "-"
        write_idx(folder / f"{prefix}-images{sep}idx3-ubyte{suffix}", images)
        write_idx(folder / f"{prefix}-labels{sep}idx1-ubyte{suffix}", labels)
        arrays[split] = (images, labels)
    return arrays


def write_pickle(path: Path, batch: object) -> Path:
    """Pickles ``batch`` (protocol 2, as the CIFAR files are) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(batch, protocol=2))
    return path


def cifar_batch(n: int, rng: np.random.Generator, **labels: list[int]) -> CifarBatch:
    """One CIFAR batch dict: ``b"data"`` of shape (n, 3072) uint8 plus the given label lists.

    Write it with ``write_pickle`` to make a CIFAR file of your own, e.g. a corrupt one.

    Examples:
        >>> import numpy as np
        >>> from meshkit.testing._files import cifar_batch
        >>> batch = cifar_batch(2, np.random.default_rng(0), labels=[3, 1])
        >>> batch[b"data"].shape, batch[b"labels"]
        ((2, 3072), [3, 1])
    """
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return {b"data": data, **{key.encode(): value for key, value in labels.items()}}


def write_cifar10(
    folder: Path, per_batch: int = 2, seed: int = 0
) -> dict[str, list[dict[bytes, object]]]:
    """The six CIFAR-10 pickles (``data_batch_1`` to ``5``, ``test_batch``), by split."""
    rng = np.random.default_rng(seed)
    batches: dict[str, list[CifarBatch]] = {"train": [], "test": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch).tolist()
        batch = cifar_batch(per_batch, rng, labels=labels, batch_label=[0])
        write_pickle(folder / name, batch)
        batches["test" if name == "test_batch" else "train"].append(batch)
    return batches


def write_cifar100(folder: Path, n: int = 3, seed: int = 0) -> dict[str, CifarBatch]:
    """The two CIFAR-100 pickles (``train``, ``test``) with fine and coarse labels."""
    rng = np.random.default_rng(seed)
    batches = {}
    for split in ("train", "test"):
        fine, coarse = rng.integers(0, 100, n).tolist(), rng.integers(0, 20, n).tolist()
        batches[split] = cifar_batch(n, rng, fine_labels=fine, coarse_labels=coarse)
        write_pickle(folder / split, batches[split])
    return batches
