"""Image records: encoded JPEG/PNG images with integer labels, in ArrayRecord files.

Record format (``meshkit.image_records.v1``): each ArrayRecord record is one msgpack
map with exactly two keys, ``"image"`` (binary: the JPEG or PNG file's bytes, as a
decoder reads them) and ``"label"`` (an integer). msgpack is a small, documented
binary encoding with readers in every common language; unlike JSON it stores bytes as
they are (no base64), unlike pickle it runs no code and needs no Python to read, and
unlike ``tf.train.Example`` it needs no schema or protobuf compiler. A record costs the
image's bytes plus about 20 bytes.

Layout: ``path`` itself (one shard) or ``path-00000-of-00004``, ... (several), and a
JSON sidecar ``path + ".json"`` with the format name, the record count, the shard
files and their counts, ``num_classes``, the class names when known, and the image
format (``"jpeg"``, ``"png"`` or ``"mixed"``). :func:`image_records` reads the sidecar
and opens the shards as one :class:`~meshkit.data.EncodedRecordSource`. Images stay
encoded in the decoded example; decoding pixels is the per-example transform's job.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

from meshkit._checks import check_int
from meshkit.data._labels import check_labels

from ._array_record import IMAGE_RECORDS_FORMAT, error_reason, sidecar_path
from ._encoded import EncodedRecordSource

FORMAT = IMAGE_RECORDS_FORMAT
"""The ``format`` entry of every image-record sidecar."""

ImageFormat = Literal["jpeg", "png"]

_MAGIC: dict[str, tuple[bytes, ...]] = {
    "jpeg": (b"\xff\xd8\xff",),
    "png": (b"\x89PNG\r\n\x1a\n",),
}
_SUFFIXES = frozenset({".jpg", ".jpeg", ".png"})
_INT32 = np.iinfo(np.int32)


def image_format_of(data: bytes) -> ImageFormat | None:
    """``"jpeg"`` or ``"png"`` from the file's first bytes (its magic number), else ``None``.

    Examples:
        >>> image_format_of(b"\\x89PNG\\r\\n\\x1a\\n...."), image_format_of(b"GIF89a")
        ('png', None)
    """
    for name, magics in _MAGIC.items():
        if bytes(data[:8]).startswith(magics):
            return name  # type: ignore[return-value]
    return None


def encode_image_record(image: bytes, label: int) -> bytes:
    """One record: the msgpack map ``{"image": image, "label": label}``.

    Args:
        image: An encoded image (a JPEG or PNG file's bytes); stored as they are.
        label: The class index (an int32 value).

    Examples:
        >>> data = encode_image_record(b"\\x89PNG\\r\\n\\x1a\\n", 7)
        >>> record = decode_image_record(data)
        >>> record["image"][:4], int(record["label"]), record["label"].dtype
        (b'\\x89PNG', 7, dtype('int32'))
    """
    if not isinstance(image, bytes | bytearray | memoryview):
        raise TypeError(
            f"image must be the encoded image's bytes; got {type(image).__name__}. Encode "
            "pixels first (write_image_records does it for uint8 arrays)."
        )
    label = check_int(label, name="label")
    if not _INT32.min <= label <= _INT32.max:
        raise ValueError(f"label must fit in int32; got {label}.")
    data = msgpack.packb({"image": bytes(image), "label": label}, use_bin_type=True)
    assert isinstance(data, bytes)  # packb returns None only when given a stream
    return data


def decode_image_record(data: bytes) -> dict[str, Any]:
    """Reads a record of :func:`encode_image_record`: ``{"image": bytes, "label": int32}``.

    The image stays encoded; decode its pixels in the per-example transform.

    Raises:
        ValueError: ``data`` is not a msgpack map of exactly a binary ``"image"`` and
            an integer ``"label"``.
    """
    try:
        record = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises several types for malformed input
        raise ValueError(f"not a msgpack image record ({error_reason(error)})") from None
    if not isinstance(record, dict) or set(record) != {"image", "label"}:
        found = sorted(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"expected a msgpack map with keys ['image', 'label'] ({FORMAT}); found {found}"
        )
    image, label = record["image"], record["label"]
    if not isinstance(image, bytes) or isinstance(label, bool) or not isinstance(label, int):
        raise ValueError(
            f"expected 'image' as binary and 'label' as an integer; found "
            f"{type(image).__name__} and {type(label).__name__}"
        )
    return {"image": image, "label": np.int32(label)}


def _encode_pixels(image: Any, index: int, *, format: ImageFormat, quality: int) -> bytes:
    """``image.encode`` of a uint8 image, or a ``ValueError`` naming image ``index``."""
    from meshkit.data import image as image_ops

    array = np.asarray(image)
    try:
        return image_ops.encode(array, format=format, quality=quality)
    except ValueError as error:
        raise ValueError(
            f"Image {index} ({array.dtype}{list(array.shape)}) cannot be encoded as {format}: "
            f"{error} Pass uint8 [H, W] or [H, W, C] pixels (floats in [0, 1]: "
            "(image * 255).round().astype(np.uint8)) or JPEG/PNG bytes."
        ) from None


def _shard_paths(path: Path, num_shards: int) -> list[Path]:
    if num_shards == 1:
        return [path]
    return [path.with_name(f"{path.name}-{i:05d}-of-{num_shards:05d}") for i in range(num_shards)]


def _write_shards(
    path: Path, records: Iterator[bytes], count: int, num_shards: int
) -> list[tuple[Path, int]]:
    """Writes ``count`` records into ``num_shards`` files of near-equal counts (atomic)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    shards = _shard_paths(path, num_shards)
    bounds = [count * i // num_shards for i in range(num_shards + 1)]
    partials = [shard.with_name(shard.name + ".partial") for shard in shards]
    try:
        for partial, start, stop in zip(partials, bounds, bounds[1:], strict=False):
            writer = ArrayRecordWriter(str(partial), "group_size:1")  # fast random access
            try:
                for _ in range(start, stop):
                    writer.write(next(records))
            finally:
                writer.close()
    except BaseException:
        for partial in partials:
            partial.unlink(missing_ok=True)
        raise
    for partial, shard in zip(partials, shards, strict=True):
        partial.replace(shard)
    return [
        (shard, stop - start)
        for shard, start, stop in zip(shards, bounds, bounds[1:], strict=False)
    ]


def _write_image_dataset(
    path: str | Path,
    items: Iterable[tuple[bytes, int]],
    *,
    count: int,
    num_shards: int,
    num_classes: int,
    class_names: Sequence[str] | None,
    extra: dict[str, Any] | None = None,
) -> list[Path]:
    """Writes ``count`` (image bytes, label) pairs as image records, then the sidecar."""
    path = Path(path)
    num_shards = check_int(num_shards, name="num_shards", minimum=1)
    if num_shards > count:
        raise ValueError(f"num_shards={num_shards} is more than the {count} records; pass fewer.")
    formats: set[str] = set()

    def records() -> Iterator[bytes]:
        for image, label in items:
            formats.add(image_format_of(image) or "unknown")
            yield encode_image_record(image, label)

    shards = _write_shards(path, records(), count, num_shards)
    sidecar = {
        "format": FORMAT,
        "encoding": "msgpack map {'image': binary, 'label': int}",
        "count": count,
        "num_classes": num_classes,
        **({"class_names": list(class_names)} if class_names is not None else {}),
        "image_format": formats.pop() if len(formats) == 1 else "mixed",
        "shards": [{"file": shard.name, "count": n} for shard, n in shards],
        **(extra or {}),
    }
    sidecar_path(path).write_text(json.dumps(sidecar, indent=1) + "\n")
    return [shard for shard, _ in shards]


def _check_classes(
    labels_N: np.ndarray, num_classes: int | None, class_names: Sequence[str] | None
) -> tuple[int, list[str] | None]:
    names = None if class_names is None else [str(name) for name in class_names]
    if names is not None and num_classes is not None and len(names) != num_classes:
        raise ValueError(f"{len(names)} class_names for num_classes={num_classes}; pass one each.")
    if num_classes is None:
        num_classes = len(names) if names is not None else int(labels_N.max()) + 1
    check_labels(labels_N, where="write_image_records", num_classes=num_classes)
    return num_classes, names


def write_image_records(
    path: str | Path,
    images: np.ndarray | Sequence[bytes | np.ndarray],
    labels: Sequence[int] | np.ndarray,
    *,
    format: ImageFormat = "jpeg",
    quality: int = 90,
    num_shards: int = 1,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> list[Path]:
    """Writes labelled images as image records (see the module docstring for the format).

    Each image is either already encoded (JPEG or PNG ``bytes``, stored as they are) or
    a uint8 array ``[H, W]`` / ``[H, W, C]``, encoded here with Pillow as ``format``.
    Shards are written under temporary names and renamed when complete; the sidecar
    ``path + ".json"`` is written last.

    Args:
        path: The records file (one shard) or the stem of the shards
            (``path-00000-of-00003``, ...); missing parent folders are created.
        images: A uint8 array ``[N, H, W(, C)]``, or a sequence of encoded images or
            uint8 arrays (which may differ in size).
        labels: ``N`` integer class indices.
        format: ``"jpeg"`` or ``"png"`` (lossless), for images given as arrays.
        quality: JPEG quality, 1 to 100 (above 95 grows files for little gain).
        num_shards: Files to spread the records over, in order (near-equal counts).
        num_classes: The number of classes; by default ``len(class_names)``, else the
            largest label plus one.
        class_names: The name of each class, kept in the sidecar.

    Returns:
        The shard paths, in record order.

    Raises:
        ValueError: The counts differ, a label is not a class, an image is neither
            JPEG/PNG bytes nor a uint8 array, or an argument is out of range.

    Examples:
        >>> import tempfile
        >>> images = np.zeros((4, 8, 8, 3), np.uint8)
        >>> path = f"{tempfile.mkdtemp()}/train.array_record"
        >>> [p.name for p in write_image_records(path, images, [0, 1, 2, 1], num_shards=2)]
        ['train.array_record-00000-of-00002', 'train.array_record-00001-of-00002']
        >>> source = image_records(path)
        >>> len(source), source.num_classes, source[3]["image"][:3], int(source[3]["label"])
        (4, 3, b'\\xff\\xd8\\xff', 1)
    """
    if format not in _MAGIC:
        raise ValueError(f"format must be 'jpeg' or 'png'; got {format!r}.")
    quality = check_int(quality, name="quality", minimum=1)
    if quality > 100:
        raise ValueError(f"quality must be in [1, 100] (JPEG); got {quality}.")
    labels_N = np.asarray(labels)
    if labels_N.ndim != 1 or len(labels_N) != len(images):
        raise ValueError(
            f"Got {len(images)} images and labels of shape {list(labels_N.shape)}; expected "
            "one integer label per image."
        )
    if len(labels_N) == 0:
        raise ValueError(f"Cannot write {path}: no images.")
    num_classes, names = _check_classes(labels_N, num_classes, class_names)

    def items() -> Iterator[tuple[bytes, int]]:
        for index, (image, label) in enumerate(zip(images, labels_N, strict=True)):
            if isinstance(image, bytes | bytearray | memoryview):
                if image_format_of(image) is None:
                    raise ValueError(
                        f"Image {index} is {len(image)} bytes starting {bytes(image[:8])!r}: "
                        "not a JPEG or PNG file. Pass JPEG/PNG bytes, or uint8 pixels to "
                        "encode."
                    )
                yield bytes(image), int(label)
            else:
                yield _encode_pixels(image, index, format=format, quality=quality), int(label)

    return _write_image_dataset(
        path,
        items(),
        count=len(labels_N),
        num_shards=num_shards,
        num_classes=num_classes,
        class_names=names,
    )


def _read_sidecar(path: Path) -> dict[str, Any]:
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"No sidecar at {sidecar}. Write image records with "
            "meshkit.data.write_image_records or `python -m meshkit.data.convert`; read "
            "record files without a sidecar with "
            "EncodedRecordSource(paths, decode=decode_image_record)."
        )
    try:
        spec = json.loads(sidecar.read_text())
        if spec.get("format") != FORMAT:
            raise ValueError(f"format {spec.get('format')!r}, expected {FORMAT!r}")
        spec["shards"] = [(str(s["file"]), int(s["count"])) for s in spec["shards"]]
        spec["count"] = int(spec["count"])
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        hint = (
            " It describes a fixed-shape file: open it with meshkit.data.ArrayRecordSource."
            if "meshkit.array_record" in sidecar.read_text()
            else ""
        )
        raise ValueError(
            f"{sidecar} is not an image-record sidecar ({type(error).__name__}: {error}); "
            f"expected JSON with format {FORMAT!r}, 'count' and 'shards' as written by "
            f"write_image_records.{hint}"
        ) from None
    return spec


def image_records(path: str | Path, *, ignore_label: int | None = None) -> EncodedRecordSource:
    """Opens image records written by :func:`write_image_records` (all shards, one source).

    Examples ``source[i]`` are ``{"image": bytes, "label": int32}``, the image still
    encoded. The source carries the sidecar's ``num_classes`` (labels are checked
    against it as they are read) and ``class_names`` (``None`` when not written).

    Args:
        path: The path given to the writer (the sidecar is ``path + ".json"``).
        ignore_label: A label value admitted besides the classes.

    Raises:
        FileNotFoundError: The sidecar or a shard is missing.
        ValueError: The sidecar is malformed, or the shards' record counts differ from it.
    """
    path = Path(path)
    spec = _read_sidecar(path)
    files = [path.with_name(name) for name, _ in spec["shards"]]
    source = EncodedRecordSource(
        files,
        decode=decode_image_record,
        num_classes=spec.get("num_classes"),
        ignore_label=ignore_label,
        class_names=spec.get("class_names"),
    )
    if len(source) != spec["count"]:
        raise ValueError(
            f"{path}'s shards hold {len(source)} records but {sidecar_path(path)} says "
            f"{spec['count']}; the files do not belong together. Write them again."
        )
    return source
