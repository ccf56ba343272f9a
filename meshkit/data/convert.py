"""Converts MNIST, Fashion-MNIST or CIFAR files a user already has to ArrayRecord.

Command line (nothing is downloaded; ``--data-dir`` must hold the original files)::

    python -m meshkit.data.convert mnist --data-dir ~/data/mnist --out ~/data/mnist-ar

writes ``train.array_record`` and ``test.array_record`` (each with a ``.json``
sidecar) and prints their record counts and sizes. Read them back with
``meshkit.data.ArrayRecordSource``. CIFAR pickles are read with a restricted unpickler
that rebuilds numpy arrays, dicts, lists, bytes and numbers only: a file naming any other
global is refused before anything it names is called. The sidecars record the number of
classes, so reading a record back checks its label against it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, get_args

from ._array_record import sidecar_path, write_array_record
from ._files import cifar10, cifar100, fashion_mnist, mnist
from ._source import ArraySource

Kind = Literal["mnist", "fashion_mnist", "cifar10", "cifar100"]

_READERS: dict[str, Callable[[Path, Literal["train", "test"]], ArraySource]] = {
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "cifar10": cifar10,
    "cifar100": cifar100,
}


def convert(
    kind: Kind,
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    label: Literal["fine", "coarse"] = "fine",
) -> list[Path]:
    """Reads both splits of a data set from ``data_dir`` and writes them as ArrayRecord.

    Both splits are read (and validated) before anything is written, so a missing or
    corrupt file leaves ``out_dir`` untouched.

    Args:
        kind: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"`` or ``"cifar100"``.
        data_dir: Folder holding the original files (see :func:`mnist`,
            :func:`cifar10`, :func:`cifar100`).
        out_dir: Folder to write ``train.array_record`` and ``test.array_record``
            (each with a ``.json`` sidecar) into; created if missing.
        label: CIFAR-100 only: store the ``"fine"`` or ``"coarse"`` label.

    Returns:
        The two ArrayRecord paths, train first.

    Examples:
        >>> import pickle, tempfile, numpy as np
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> data = np.zeros((2, 3072), np.uint8)
        >>> for name in ("train", "test"):
        ...     batch = {b"data": data, b"fine_labels": [1, 2], b"coarse_labels": [0, 1]}
        ...     _ = (folder / name).write_bytes(pickle.dumps(batch))
        >>> [path.name for path in convert("cifar100", folder, folder / "out")]
        ['train.array_record', 'test.array_record']
    """
    if kind not in _READERS:
        raise ValueError(f"kind must be one of {list(_READERS)}; got {kind!r}.")
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if kind == "cifar100":
        sources = {split: cifar100(data_dir, split, label=label) for split in ("train", "test")}
    else:
        sources = {split: _READERS[kind](data_dir, split) for split in ("train", "test")}
    return [
        write_array_record(source, out_dir / f"{split}.array_record")
        for split, source in sources.items()
    ]


def _describe(path: Path) -> str:
    count = json.loads(sidecar_path(path).read_text())["count"]
    return f"{path}: {count:,} records, {path.stat().st_size:,} bytes (+ {sidecar_path(path).name})"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring.

    Examples:
        >>> import pickle, tempfile, numpy as np
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> batch = {b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1, 2]}
        >>> for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        ...     _ = (folder / name).write_bytes(pickle.dumps(batch))
        >>> args = ["cifar10", "--data-dir", str(folder), "--out", str(folder / "out")]
        >>> main(args)  # doctest: +ELLIPSIS
        wrote .../out/train.array_record: 15 records, ... bytes (+ train.array_record.json)
        wrote .../out/test.array_record: 3 records, ... bytes (+ test.array_record.json)
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m meshkit.data.convert",
        description="Convert MNIST, Fashion-MNIST or CIFAR files you already have to ArrayRecord.",
        epilog=(
            "Nothing is downloaded. CIFAR pickles are read with a restricted unpickler: a "
            "file that names anything but numpy arrays, dicts, lists, bytes and numbers "
            "(os.system, builtins.eval, ...) is refused before it runs."
        ),
    )
    parser.add_argument("kind", choices=get_args(Kind))
    parser.add_argument("--data-dir", type=Path, required=True, help="folder with the files")
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument("--label", choices=("fine", "coarse"), default="fine", help="CIFAR-100")
    args = parser.parse_args(argv)
    try:
        paths = convert(args.kind, args.data_dir, args.out, label=args.label)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    for path in paths:
        print(f"wrote {_describe(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
