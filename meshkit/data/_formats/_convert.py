"""The conversions behind ``python -m meshkit.data.convert`` (see that module).

``convert`` writes a named data set (MNIST, Fashion-MNIST, CIFAR, digits) as ArrayRecord
or encoded image records; ``main`` parses the command line, and also converts image
folders.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, get_args

from meshkit.data._source import ArraySource

from ._array_record import sidecar_path, write_array_record
from ._digits import digits
from ._files import cifar10, cifar100, fashion_mnist, mnist
from ._image_records import ImageFormat, image_records, write_image_records
from ._image_sets import to_uint8_images, write_image_folder

Kind = Literal["mnist", "fashion_mnist", "cifar10", "cifar100", "digits"]

_READERS: dict[str, Callable[[Path, Literal["train", "test"]], ArraySource]] = {
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "cifar10": cifar10,
    "cifar100": cifar100,
}

_CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "mnist": tuple("0123456789"),
    "digits": tuple("0123456789"),
    "fashion_mnist": (
        *("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"),
        *("Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    ),
    "cifar10": (
        *("airplane", "automobile", "bird", "cat", "deer"),
        *("dog", "frog", "horse", "ship", "truck"),
    ),
}
"""Class names kept in image-record sidecars (CIFAR-100's live in its ``meta`` file)."""


def _read(
    kind: str, data_dir: Path | None, split: Literal["train", "test"], label: str
) -> ArraySource:
    if kind == "digits":
        return digits(split)
    if data_dir is None:
        raise ValueError(f"{kind} needs data_dir, the folder holding its files; got None.")
    if kind == "cifar100":
        return cifar100(data_dir, split, label="coarse" if label == "coarse" else "fine")
    return _READERS[kind](data_dir, split)


def convert(
    kind: Kind,
    data_dir: str | Path | None,
    out_dir: str | Path,
    *,
    label: Literal["fine", "coarse"] = "fine",
    encoded: ImageFormat | None = None,
    size: int | None = None,
    rgb: bool = False,
    quality: int = 90,
    num_shards: int = 1,
) -> list[Path]:
    """Reads both splits of a data set and writes them as ArrayRecord.

    Without ``encoded`` each split becomes a fixed-shape file (:func:`write_array_record`,
    read with :class:`~meshkit.data.ArrayRecordSource`); with ``encoded="jpeg"`` or
    ``"png"`` its images become encoded image records
    (:func:`~meshkit.data.write_image_records`, read with
    :func:`~meshkit.data.image_records`), with class names in the sidecar when known.
    Both splits are read (and validated) before anything is written, so a missing or
    corrupt file leaves ``out_dir`` untouched.

    Args:
        kind: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``, ``"cifar100"`` or
            ``"digits"`` (the embedded 8×8 digits, no ``data_dir``).
        data_dir: Folder holding the original files (see :func:`mnist`,
            :func:`cifar10`, :func:`cifar100`); ``None`` for ``"digits"``.
        out_dir: Folder to write ``train.array_record`` and ``test.array_record``
            (each with a ``.json`` sidecar) into; created if missing.
        label: CIFAR-100 only: store the ``"fine"`` or ``"coarse"`` label.
        encoded: ``"jpeg"`` or ``"png"`` to write encoded image records.
        size: With ``encoded``: enlarge (or shrink) the images to ``size``×``size``
            bilinearly.
        rgb: With ``encoded``: repeat a gray channel into three.
        quality: With ``encoded="jpeg"``: the JPEG quality.
        num_shards: With ``encoded``: files per split.

    Returns:
        The ArrayRecord paths (the shards, with ``num_shards > 1``), train first.

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
    if kind not in (*_READERS, "digits"):
        raise ValueError(f"kind must be one of {[*_READERS, 'digits']}; got {kind!r}.")
    if encoded is None and (size is not None or rgb or num_shards != 1):
        raise ValueError(
            f"size={size}, rgb={rgb} and num_shards={num_shards} apply to encoded image "
            "records only; pass encoded='jpeg' or 'png', or leave them at their defaults."
        )
    folder = None if data_dir is None else Path(data_dir)
    splits: tuple[Literal["train", "test"], ...] = ("train", "test")
    sources = {split: _read(kind, folder, split, label) for split in splits}
    out_dir = Path(out_dir)
    if encoded is None:
        return [
            write_array_record(source, out_dir / f"{split}.array_record")
            for split, source in sources.items()
        ]
    paths = []
    for split, source in sources.items():
        paths += write_image_records(
            out_dir / f"{split}.array_record",
            to_uint8_images(source.arrays["image"], size=size, rgb=rgb),
            source.arrays["label"],
            format=encoded,
            quality=quality,
            num_shards=num_shards,
            num_classes=source.num_classes,
            class_names=_CLASS_NAMES.get(kind),
        )
    return paths


def _describe(path: Path) -> str:
    """``PATH: N records, B bytes (+ sidecar)``, for a file or a set of shards."""
    stem = path.with_name(path.name.split("-00000-of-")[0])
    sidecar = sidecar_path(stem)
    spec = json.loads(sidecar.read_text())
    shards = [stem.with_name(s["file"]) for s in spec.get("shards", [{"file": stem.name}])]
    size = sum(shard.stat().st_size for shard in shards)
    files = f" in {len(shards)} files" if len(shards) > 1 else ""
    return f"{stem}: {spec['count']:,} records{files}, {size:,} bytes (+ {sidecar.name})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m meshkit.data.convert",
        description=(
            "Convert data you already have to ArrayRecord: MNIST, Fashion-MNIST or CIFAR "
            "files, the embedded digits, or an image folder."
        ),
        epilog=(
            "Nothing is downloaded. CIFAR pickles are read with a restricted unpickler: a "
            "file that names anything but numpy arrays, dicts, lists, bytes and numbers "
            "(os.system, builtins.eval, ...) is refused before it runs. Run "
            "`python -m meshkit.data.convert KIND --help` for a kind's options."
        ),
    )
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind in get_args(Kind):
        what = "the embedded 8×8 digits" if kind == "digits" else f"{kind} files you have"
        sub = kinds.add_parser(kind, help=f"both splits of {what}")
        if kind != "digits":
            sub.add_argument("--data-dir", type=Path, required=True, help="folder with the files")
        sub.add_argument("--out", type=Path, required=True, help="folder to write into")
        if kind == "cifar100":
            sub.add_argument("--label", choices=("fine", "coarse"), default="fine")
        sub.add_argument(
            "--encoded",
            choices=get_args(ImageFormat),
            help="write encoded image records (default: fixed-shape arrays)",
        )
        sub.add_argument("--size", type=int, help="with --encoded: resize images to SIZE×SIZE")
        sub.add_argument("--rgb", action="store_true", help="with --encoded: gray to 3 channels")
        sub.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
        sub.add_argument("--shards", type=int, default=1, help="with --encoded: files per split")
    images = kinds.add_parser(
        "images", help="an image folder ROOT/<class name>/*.jpg|*.png to image records"
    )
    images.add_argument("--from-folder", type=Path, required=True, metavar="ROOT")
    images.add_argument("--out", type=Path, required=True, help="the records file to write")
    images.add_argument("--shards", type=int, default=1, help="files to write (default 1)")
    images.add_argument(
        "--reencode",
        choices=get_args(ImageFormat),
        help="decode and re-encode every image (default: keep the files as they are)",
    )
    images.add_argument("--quality", type=int, default=90, help="JPEG quality when re-encoding")
    images.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="store the files without decoding each once (default: decode, so a damaged "
        "file is named now, not in training)",
    )
    images.add_argument(
        "--class-names-from",
        type=Path,
        metavar="RECORDS",
        help="take the classes and their indices from these image records (e.g. the "
        "training split's), so that both splits agree even if a class folder is missing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see :mod:`meshkit.data.convert`.

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
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.kind == "images":
            like = args.class_names_from
            class_names = None if like is None else image_records(like).class_names
            if like is not None and class_names is None:
                raise ValueError(f"{like} records no class names; convert it from a folder.")
            paths = write_image_folder(
                args.from_folder,
                args.out,
                num_shards=args.shards,
                reencode=args.reencode,
                quality=args.quality,
                class_names=class_names,
                verify=args.verify,
            )
        else:
            paths = convert(
                args.kind,
                getattr(args, "data_dir", None),
                args.out,
                label=getattr(args, "label", "fine"),
                encoded=args.encoded,
                size=args.size,
                rgb=args.rgb,
                quality=args.quality,
                num_shards=args.shards,
            )
    except (FileNotFoundError, ValueError, TypeError) as error:
        parser.error(str(error))
    for path in paths:
        if "-of-" not in path.name or "-00000-of-" in path.name:
            print(f"wrote {_describe(path)}")
    return 0
