"""Readers for data files a user already has: MNIST-style IDX files and CIFAR pickles.

Nothing here downloads. Every reader validates what it reads and raises a
``FileNotFoundError`` or ``ValueError`` naming the file, what was found and what was
expected.

Security: CIFAR's official format is Python pickle, and a plain ``pickle.load`` runs
any function the file names. CIFAR files are read with a restricted unpickler
(``meshkit.data._formats._unpickle``) that rebuilds dicts, lists, bytes, numbers and numpy
arrays only and refuses a file naming any other global before calling it. Converting
them once with ``python -m meshkit.data.convert`` to ArrayRecord (raw bytes only)
leaves no pickle to read at all.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import Literal

import numpy as np

from meshkit.data._labels import check_labels
from meshkit.data._source import ArraySource

from ._unpickle import load_cifar_pickle

IDX_IMAGES_MAGIC = 2051
"""Magic number of an IDX file of unsigned bytes with 3 dimensions (images)."""

IDX_LABELS_MAGIC = 2049
"""Magic number of an IDX file of unsigned bytes with 1 dimension (labels)."""

CIFAR_RECORD_SIZE = 3 * 32 * 32

_MNIST_NAMES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
_MNIST_PREFIX = {"train": "train", "test": "t10k"}


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")


def _idx_candidates(data_dir: Path, prefix: str, kind: str, idx: str) -> list[Path]:
    names = (f"{prefix}-{kind}-{idx}-ubyte", f"{prefix}-{kind}.{idx}-ubyte")
    return [data_dir / (name + suffix) for name in names for suffix in ("", ".gz")]


def _read_file_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when its name ends in ``.gz``."""
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as file:
            return file.read()
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(
            f"Cannot decompress {path}: {error}. A file named *.gz must be a complete gzip "
            "file; re-download it, or drop the .gz suffix if it is not compressed."
        ) from None


def _parse_idx(path: Path, data: bytes, magic: int, ndim: int) -> np.ndarray:
    """Validates an IDX header (big-endian magic and dimensions) and returns the uint8 body."""
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(
            f"{path} is truncated: an IDX header with {ndim} dimension(s) needs {header} "
            f"bytes, found {len(data)}."
        )
    (found_magic,) = struct.unpack_from(">i", data)
    if found_magic != magic:
        hint = (
            " It looks gzip-compressed: name it with a .gz suffix."
            if data[:2] == b"\x1f\x8b"
            else ""
        )
        raise ValueError(
            f"{path} has IDX magic number {found_magic}; expected {magic} "
            f"({'images' if magic == IDX_IMAGES_MAGIC else 'labels'}, unsigned bytes).{hint}"
        )
    dims = struct.unpack_from(f">{ndim}I", data, 4)
    expected = math.prod(dims)
    found = len(data) - header
    if found != expected:
        shape = "×".join(map(str, dims))
        problem = "is truncated" if found < expected else "has trailing bytes"
        raise ValueError(
            f"{path} {problem}: its header declares {shape} = {expected} bytes of data, "
            f"found {found}."
        )
    return np.frombuffer(data, np.uint8, count=expected, offset=header).reshape(dims)


def _find_idx_files(data_dir: Path, split: str, dataset: str) -> tuple[Path, Path]:
    prefix = _MNIST_PREFIX[split]
    candidates = {
        "images": _idx_candidates(data_dir, prefix, "images", "idx3"),
        "labels": _idx_candidates(data_dir, prefix, "labels", "idx1"),
    }
    found = {
        kind: next((p for p in paths if p.is_file()), None) for kind, paths in candidates.items()
    }
    missing = [kind for kind, path in found.items() if path is None]
    if missing:
        name = _MNIST_NAMES[dataset]
        expected = " and ".join(candidates[kind][0].name for kind in missing)
        raise FileNotFoundError(
            f"{name} {split} {' and '.join(missing)} not found: "
            + _absent(
                data_dir,
                f"{expected} (gzipped or not, or dotted: {candidates[missing[0]][2].name})",
            )
            + f". Download the four {name} IDX files from the dataset's homepage into "
            f"{data_dir} (--data-dir)."
        )
    images_path, labels_path = found["images"], found["labels"]
    assert images_path is not None and labels_path is not None
    return images_path, labels_path


def _read_idx_pair(data_dir: str | Path, split: str, dataset: str) -> ArraySource:
    _check_split(split)
    data_dir = Path(data_dir)
    images_path, labels_path = _find_idx_files(data_dir, split, dataset)
    images_NxHxW = _parse_idx(images_path, _read_file_bytes(images_path), IDX_IMAGES_MAGIC, 3)
    labels_N = _parse_idx(labels_path, _read_file_bytes(labels_path), IDX_LABELS_MAGIC, 1)
    if len(images_NxHxW) != len(labels_N):
        raise ValueError(
            f"{images_path} holds {len(images_NxHxW)} images but {labels_path} holds "
            f"{len(labels_N)} labels; the two files must come from the same split."
        )
    check_labels(labels_N, where=str(labels_path), num_classes=10)
    arrays = {"image": images_NxHxW[..., None], "label": labels_N.astype(np.int32)}
    return ArraySource(arrays, name=f"{dataset}-{split}", num_classes=10)


def mnist(data_dir: str | Path, split: Literal["train", "test"]) -> ArraySource:
    """MNIST from the four IDX files in ``data_dir`` (no download).

    Reads ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` (``"train"``) or
    ``t10k-images-idx3-ubyte`` / ``t10k-labels-idx1-ubyte`` (``"test"``), each
    optionally gzipped (``.gz``) and also under the dotted names
    (``train-images.idx3-ubyte``). Headers are checked: magic 2051 for images, 2049
    for labels, big-endian dimensions, and a body of exactly N×rows×cols bytes.

    Args:
        data_dir: Folder holding the IDX files.
        split: ``"train"`` or ``"test"``.

    Returns:
        An :class:`ArraySource` with ``"image"`` uint8 ``[rows, cols, 1]`` (28×28×1
        for MNIST) and ``"label"`` int32.

    Raises:
        FileNotFoundError: A file is missing; the message names it and the folder.
        ValueError: A file is corrupt, truncated, or the counts differ.

    Examples:
        >>> import struct, tempfile, numpy as np
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> pixels = np.arange(2 * 28 * 28, dtype=np.uint32).astype(np.uint8)
        >>> images = struct.pack(">4i", 2051, 2, 28, 28) + pixels.tobytes()
        >>> _ = (folder / "t10k-images-idx3-ubyte").write_bytes(images)
        >>> labels = struct.pack(">2i", 2049, 2) + bytes([3, 7])
        >>> _ = (folder / "t10k-labels-idx1-ubyte").write_bytes(labels)
        >>> source = mnist(folder, "test")
        >>> len(source), source[1]["image"].shape, int(source[1]["label"])
        (2, (28, 28, 1), 7)
    """
    return _read_idx_pair(data_dir, split, "mnist")


def fashion_mnist(data_dir: str | Path, split: Literal["train", "test"]) -> ArraySource:
    """Fashion-MNIST from its four IDX files in ``data_dir``: same format as :func:`mnist`.

    Only the messages and the fingerprint's name differ from :func:`mnist`.

    Examples:
        >>> import tempfile
        >>> try:
        ...     fashion_mnist(tempfile.mkdtemp(), "train")
        ... except FileNotFoundError as error:
        ...     print(str(error).split(":")[0])
        Fashion-MNIST train images and labels not found
    """
    return _read_idx_pair(data_dir, split, "fashion_mnist")


def _find_cifar_files(data_dir: Path, subdir: str, names: list[str], title: str) -> list[Path]:
    """The batch files, all in ``data_dir`` or all in ``data_dir / subdir``."""
    folders = [data_dir, data_dir / subdir]
    for folder in folders:
        if all((folder / name).is_file() for name in names):
            return [folder / name for name in names]
    archive = "cifar-10-python" if title == "CIFAR-10" else "cifar-100-python"
    raise FileNotFoundError(
        f"{title} {', '.join(names)} not found: "
        + _absent(data_dir, f"such file{'s' * (len(names) > 1)}, nor does its {subdir}/ folder")
        + ". Download the "
        f"{title} python version ({archive}.tar.gz) from the dataset's homepage and extract "
        f"it into {data_dir} (--data-dir)."
    )


def _absent(data_dir: Path, what: str) -> str:
    """What a missing-file message says of the folder: that it does not exist, or lacks ``what``."""
    return f"{data_dir} holds no {what}" if data_dir.is_dir() else f"{data_dir} does not exist"


def _unpickle(path: Path, keys: tuple[bytes, ...]) -> dict[bytes, object]:
    batch = load_cifar_pickle(path)
    if not isinstance(batch, dict) or not all(key in batch for key in keys):
        found = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            f"{path} is not a CIFAR batch: expected a dict with keys {list(keys)}; found {found}."
        )
    return batch


def _load_cifar_batch(
    path: Path, label_key: bytes, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch as uint8 ``[N, 3072]`` (CHW order) and int32 ``[N]``."""
    batch = _unpickle(path, (b"data", label_key))
    data = np.asarray(batch[b"data"])
    if data.ndim != 2 or data.shape[1] != CIFAR_RECORD_SIZE:
        raise ValueError(
            f"{path} has data of shape {data.shape}; expected [N, {CIFAR_RECORD_SIZE}] "
            f"(records of 3×32×32 = {CIFAR_RECORD_SIZE} bytes)."
        )
    if data.dtype != np.uint8:
        raise ValueError(f"{path} has data of dtype {data.dtype}; expected uint8.")
    labels = np.asarray(batch[label_key])
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{path} has {label_key.decode()} of dtype {labels.dtype}; expected integers."
        )
    if labels.ndim != 1 or len(labels) != len(data):
        raise ValueError(
            f"{path} holds {len(data)} images but {labels.size} {label_key.decode()}; "
            "expected one label per image."
        )
    check_labels(labels, where=str(path), num_classes=num_classes)
    return data, labels.astype(np.int32)


def _read_cifar(paths: list[Path], label_key: bytes, num_classes: int, name: str) -> ArraySource:
    batches = [_load_cifar_batch(path, label_key, num_classes) for path in paths]
    data_Nx3072 = np.concatenate([data for data, _ in batches])
    images_NxHxWxC = data_Nx3072.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels_N = np.concatenate([labels for _, labels in batches])
    arrays = {"image": np.ascontiguousarray(images_NxHxWxC), "label": labels_N}
    return ArraySource(arrays, name=name, num_classes=num_classes)


def cifar10(data_dir: str | Path, split: Literal["train", "test"]) -> ArraySource:
    """CIFAR-10 from the python pickle batches in ``data_dir`` (no download).

    Reads ``data_batch_1`` … ``data_batch_5`` (``"train"``, 50,000 examples) or
    ``test_batch`` (``"test"``), found in ``data_dir`` or in its
    ``cifar-10-batches-py`` subfolder (where the official archive extracts).

    Security: the files are Python pickles. They are read with a restricted unpickler
    that rebuilds numpy arrays, dicts, lists, bytes and numbers only; a file naming any
    other global (``os.system``, ``builtins.eval``) is refused with a ``ValueError``
    before anything it names is called.

    Args:
        data_dir: Folder holding the batches (or their ``cifar-10-batches-py`` folder).
        split: ``"train"`` or ``"test"``.

    Returns:
        An :class:`ArraySource` with ``"image"`` uint8 ``[32, 32, 3]`` (HWC) and
        ``"label"`` int32 in [0, 9].

    Raises:
        FileNotFoundError: A batch is missing; the message lists every path tried.
        ValueError: A file is not a CIFAR pickle, names a disallowed global, has a wrong
            record size or count, or has labels outside [0, 9].

    Examples:
        >>> import pickle, tempfile, numpy as np
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [4, 2]}
        >>> _ = (folder / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
        >>> source = cifar10(folder, "test")
        >>> len(source), source[0]["image"].shape, int(source[1]["label"])
        (2, (32, 32, 3), 2)
    """
    _check_split(split)
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    paths = _find_cifar_files(Path(data_dir), "cifar-10-batches-py", names, "CIFAR-10")
    return _read_cifar(paths, b"labels", 10, f"cifar10-{split}")


def cifar100(
    data_dir: str | Path,
    split: Literal["train", "test"],
    *,
    label: Literal["fine", "coarse"] = "fine",
) -> ArraySource:
    """CIFAR-100 from the python pickles ``train`` / ``test`` in ``data_dir`` (no download).

    The files may sit in ``data_dir`` or in its ``cifar-100-python`` subfolder.
    Security: they are Python pickles, read with the restricted unpickler of
    :func:`cifar10`.

    Args:
        data_dir: Folder holding ``train`` and ``test`` (or their ``cifar-100-python``).
        split: ``"train"`` or ``"test"``.
        label: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).

    Returns:
        An :class:`ArraySource` with ``"image"`` uint8 ``[32, 32, 3]`` and ``"label"``
        int32.

    Raises:
        FileNotFoundError: The file is missing; the message lists every path tried.
        ValueError: The file is not a CIFAR pickle, names a disallowed global, has a
            wrong record size or count, or has labels outside the classes.

    Examples:
        >>> import pickle, tempfile, numpy as np
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp()) / "cifar-100-python"
        >>> folder.mkdir()
        >>> data = np.zeros((3, 3072), np.uint8)
        >>> batch = {b"data": data, b"fine_labels": [99, 0, 5], b"coarse_labels": [19, 0, 1]}
        >>> _ = (folder / "test").write_bytes(pickle.dumps(batch, protocol=2))
        >>> source = cifar100(folder.parent, "test", label="coarse")
        >>> [int(source[i]["label"]) for i in range(3)]
        [19, 0, 1]
    """
    _check_split(split)
    if label not in ("fine", "coarse"):
        raise ValueError(f"label must be 'fine' or 'coarse'; got {label!r}.")
    paths = _find_cifar_files(Path(data_dir), "cifar-100-python", [split], "CIFAR-100")
    key, num_classes = (b"fine_labels", 100) if label == "fine" else (b"coarse_labels", 20)
    return _read_cifar(paths, key, num_classes, f"cifar100-{split}-{label}")
