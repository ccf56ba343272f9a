"""Image records from an image folder (``root/<class>/*.jpg``) and from the embedded digits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from meshkit._checks import check_int

from ._digits import digits, resize_bilinear
from ._image_records import (
    _SUFFIXES,
    ImageFormat,
    _write_image_dataset,
    image_format_of,
    write_image_records,
)


def _scan_folder(
    root: Path, class_names: Sequence[str] | None
) -> tuple[list[str], list[tuple[Path, int]], int]:
    """Class names, ``(file, class index)`` pairs, and how many files were skipped."""
    if not root.is_dir():
        raise FileNotFoundError(f"No folder at {root}; expected root/<class name>/<image files>.")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ValueError(
            f"{root} has no class folders; expected root/<class name>/*.jpg|*.png (the "
            "ImageNet / ImageFolder layout), one folder per class."
        )
    classes = folders if class_names is None else [str(name) for name in class_names]
    unknown = sorted(set(folders) - set(classes))
    if unknown:
        raise ValueError(
            f"{root} has class folders {unknown[:5]} that are not among the {len(classes)} "
            f"class_names given ({classes[:5]}...). Pass the class names of the split these "
            "records must agree with (e.g. the training split's), or rename the folders."
        )
    files, skipped = [], 0
    for label, name in enumerate(classes):
        if name not in folders:
            continue  # a class without examples in this split
        for file in sorted((root / name).iterdir()):
            if file.is_file() and file.suffix.lower() in _SUFFIXES:
                files.append((file, label))
            elif not file.name.startswith("."):
                skipped += 1
    if not files:
        raise ValueError(f"{root}'s class folders {classes[:5]} hold no .jpg, .jpeg or .png files.")
    return classes, files, skipped


def _reencode(data: bytes, file: Path, format: ImageFormat, quality: int) -> bytes:
    """The image in ``file`` (its bytes ``data``) decoded and encoded again as ``format``."""
    from meshkit.data import image as image_ops

    try:
        pixels = image_ops.decode(data, channels=None)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None
    if format == "jpeg" and pixels.shape[-1] == 4:
        pixels = image_ops.decode(data, channels=3)  # JPEG has no alpha channel
    return image_ops.encode(pixels, format=format, quality=quality)


def _verified(data: bytes, file: Path) -> bytes:
    """``data`` after decoding it once: a damaged or cut-short image fails here, naming
    ``file``, instead of in training, naming neither the record nor the file."""
    from meshkit.data import image as image_ops

    try:
        image_ops.decode(data, channels=None)
    except ValueError as error:
        raise ValueError(
            f"{file} could not be decoded ({error}); replace or remove it and run the "
            "conversion again (--no-verify stores files without decoding them)."
        ) from None
    return data


def write_image_folder(
    root: str | Path,
    path: str | Path,
    *,
    num_shards: int = 1,
    reencode: ImageFormat | None = None,
    quality: int = 90,
    class_names: Sequence[str] | None = None,
    verify: bool = True,
) -> list[Path]:
    """Converts an image folder (``root/<class name>/*.jpg|*.jpeg|*.png``) to image records.

    Class ``i`` is the ``i``-th class folder in sorted name order (the ImageNet and
    ``ImageFolder`` convention), or its index in ``class_names``; records follow class
    order, then sorted file names
    (pipelines shuffle globally, so the order on disk does not matter for training).
    Files are stored as they are, without decoding, unless ``reencode`` is given.
    Other files are skipped and counted in the sidecar's ``skipped_files``; hidden
    files and folders (``.name``) are ignored.

    Args:
        root: The folder of class folders.
        path: The records file to write (see :func:`write_image_records`).
        num_shards: Files to spread the records over.
        reencode: ``"jpeg"`` or ``"png"`` to decode and re-encode every image (Pillow);
            ``None`` keeps the files' bytes.
        quality: JPEG quality when re-encoding.
        class_names: The classes in index order, when they must match other records
            (a test split converted after the training split, whose folder may lack a
            class): ``image_records(train_path).class_names``. Every class folder must
            be among them. By default the sorted class folders.
        verify: Decode every image once, so that a damaged or cut-short file is named
            now rather than failing a training run later (re-encoding decodes anyway).

    Returns:
        The shard paths.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: No class folders or no images, or a file named ``.jpg`` / ``.png``
            is not a JPEG or PNG file, or (with ``verify``) does not decode; the message
            names it.
    """
    root = Path(root)
    classes, files, skipped = _scan_folder(root, class_names)
    quality = check_int(quality, name="quality", minimum=1)

    def items() -> Iterator[tuple[bytes, int]]:
        for file, label in files:
            data = file.read_bytes()
            if image_format_of(data) is None:
                raise ValueError(
                    f"{file} is not a JPEG or PNG file (it starts {data[:8]!r}); remove it "
                    "or convert it, then run the conversion again."
                )
            if reencode is not None:
                yield _reencode(data, file, reencode, quality), label
            else:
                yield (_verified(data, file) if verify else data), label

    return _write_image_dataset(
        path,
        items(),
        count=len(files),
        num_shards=num_shards,
        num_classes=len(classes),
        class_names=classes,
        extra={"source": f"image folder {root.name}", "skipped_files": skipped},
    )


def to_uint8_images(
    images: np.ndarray, *, size: int | None = None, rgb: bool = False
) -> np.ndarray:
    """uint8 ``[N, size, size, C]`` images from uint8 or float ``[0, 1]`` ``[N, H, W, C]`` ones.

    ``size`` resizes bilinearly (half-pixel centres, see
    :func:`meshkit.data._formats._digits.interpolation_matrix`); ``rgb`` repeats a gray channel.

    Examples:
        >>> to_uint8_images(np.ones((2, 8, 8, 1), np.float32), size=16, rgb=True).shape
        (2, 16, 16, 3)
    """
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    floats = images.astype(np.float32) / (255.0 if images.dtype == np.uint8 else 1.0)
    if size is not None and size != images.shape[1]:
        n, h, w, c = floats.shape
        planes = floats.transpose(0, 3, 1, 2).reshape(n * c, h, w)
        floats = resize_bilinear(planes, size, size).reshape(n, c, size, size).transpose(0, 2, 3, 1)
    if rgb and floats.shape[-1] == 1:
        floats = np.repeat(floats, 3, axis=-1)
    return np.clip(np.round(floats * 255.0), 0, 255).astype(np.uint8)


def write_digits_images(
    directory: str | Path,
    *,
    size: int = 32,
    format: ImageFormat = "jpeg",
    quality: int = 90,
    splits: Sequence[Literal["train", "test"]] = ("train", "test"),
) -> dict[str, Path]:
    """Writes scikit-learn's digits as RGB image records: ``train.array_record`` (1,437
    images) and ``test.array_record`` (360), in about a second.

    The split is that of :func:`meshkit.data.digits` (the same examples in the same
    order). Each 8×8 gray image (values 0..16) is scaled to 0..255, enlarged
    bilinearly to ``size``×``size``, repeated into three channels and encoded as
    ``format``. Class names are ``"0"`` to ``"9"``.

    Args:
        directory: Folder to write into (created if missing).
        size: Height and width of the images (at least 8).
        format: ``"jpeg"`` or ``"png"`` (lossless).
        quality: JPEG quality.
        splits: The splits to write.

    Returns:
        Split name -> records path.

    Examples:
        >>> import tempfile
        >>> from meshkit.data import image_records
        >>> paths = write_digits_images(tempfile.mkdtemp(), size=16, splits=["test"])
        >>> source = image_records(paths["test"])
        >>> len(source), source.class_names[:3]
        (360, ('0', '1', '2'))
    """
    size = check_int(size, name="size", minimum=8)
    unknown = [split for split in splits if split not in ("train", "test")]
    if unknown or not splits:
        raise ValueError(f"splits must name 'train' and/or 'test'; got {list(splits)!r}.")
    paths = {}
    for split in splits:
        source = digits(split)
        (paths[split],) = write_image_records(
            Path(directory) / f"{split}.array_record",
            to_uint8_images(source.arrays["image"], size=size, rgb=True),
            source.arrays["label"],
            format=format,
            quality=quality,
            class_names=[str(digit) for digit in range(10)],
        )
    return paths
