"""Image operations: decode, encode, resize, crop, flip, normalise (numpy + Pillow).

Every random operation takes a ``np.random.Generator`` and draws from it in a fixed
order, so the pipeline's per-example generator (seeded by the example's global
position) makes augmentation exact and independent of the process layout.

Images are ``uint8`` arrays of shape ``(height, width, channels)``; sizes are an
``int`` (a square) or a ``(height, width)`` pair. The argument checks shared with the
transforms (``as_hw``, ``check_range``, ``check_image``, ``check_resample``,
``channel_stats``) live here too.
"""

from __future__ import annotations

import functools
import io
import math
from typing import Any, Literal

import numpy as np
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""ImageNet's per-channel (RGB) mean, for pixel values scaled to [0, 1]."""
IMAGENET_STD = (0.229, 0.224, 0.225)
"""ImageNet's per-channel (RGB) standard deviation, for pixel values scaled to [0, 1]."""
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
"""CIFAR-10 training set's per-channel (RGB) mean, for pixel values scaled to [0, 1]."""
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
"""CIFAR-10 training set's per-channel (RGB) standard deviation, values in [0, 1]."""

Size = int | tuple[int, int]
"""An output size: ``int`` for a square, or ``(height, width)``."""
Resample = Literal["bilinear", "bicubic"]
Encoded = bytes | np.ndarray
"""An encoded file: ``bytes``, or as read from a record, ``np.bytes_`` or a 1-D uint8 array."""
Box = tuple[int, int, int, int]
"""A crop box ``(top, left, height, width)`` in pixels."""

MODES = {1: "L", 3: "RGB", 4: "RGBA"}
"""Pillow's image mode for each number of channels an image may have."""

_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
_DECODE_FORMATS = ("JPEG", "PNG")


# ---------------------------------------------------------------------------- checks


def as_hw(size: Size, *, name: str = "size") -> tuple[int, int]:
    """``size`` as ``(height, width)`` of positive ints."""
    pair = (size, size) if isinstance(size, int | np.integer) else size
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in pair)
        or min(pair) < 1
    ):
        raise ValueError(
            f"{name} must be a positive int or a (height, width) pair of positive ints, "
            f"got {size!r}."
        )
    return int(pair[0]), int(pair[1])


def check_range(
    value: tuple[float, float], *, name: str, upper: float = math.inf
) -> tuple[float, float]:
    """``value`` as a ``(low, high)`` pair of floats with ``0 < low <= high <= upper``."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {value!r}.") from None
    if not 0 < low <= high <= upper:
        bound = "" if upper == math.inf else f" <= {upper}"
        raise ValueError(f"{name} must satisfy 0 < low <= high{bound}, got {value!r}.")
    return low, high


def check_image(image: Any, *, name: str = "image") -> np.ndarray:
    """``image`` as a ``(height, width, channels)`` array (a 2-D one gains a channel axis)."""
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or min(array.shape[:2]) < 1:
        raise ValueError(
            f"{name} must be an array of shape (height, width, channels) or (height, width), "
            f"got shape {np.shape(image)}."
        )
    return array


def check_resample(resample: str) -> Image.Resampling:
    """Pillow's resampling filter named by ``resample``."""
    if resample not in _RESAMPLE:
        raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}, got {resample!r}.")
    return _RESAMPLE[resample]


# ------------------------------------------------------------------ decode / encode


def decode(data: Encoded, *, channels: int | None = 3) -> np.ndarray:
    """Decodes JPEG or PNG bytes into a ``uint8`` array of shape ``(height, width, channels)``.

    Args:
        data: The encoded file's bytes.
        channels: 3 converts any image (grayscale, palette, RGBA, CMYK) to RGB, 1 to
            grayscale, 4 to RGBA; ``None`` keeps grayscale, RGB and RGBA as stored and
            converts other modes to RGB.

    Raises:
        ValueError: ``data`` is not a complete JPEG or PNG file; the message says what
            the bytes start with. Callers add the record's index.

    Examples:
        >>> pixels = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
        >>> np.array_equal(decode(encode(pixels, format="png")), pixels)
        True
    """
    with _open(data, channels) as img:
        return _to_array(img, channels)


def _open(data: Any, channels: int | None) -> Image.Image:
    if channels is not None and channels not in MODES:
        raise ValueError(f"channels must be 1, 3, 4 or None, got {channels!r}.")
    raw = _as_bytes(data)
    try:
        return Image.open(io.BytesIO(raw), formats=_DECODE_FORMATS)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise _decode_error(raw, error) from None


def _to_array(img: Image.Image, channels: int | None) -> np.ndarray:
    array = np.asarray(_loaded(img, channels))
    return array[:, :, None] if array.ndim == 2 else array


def _loaded(img: Image.Image, channels: int | None) -> Image.Image:
    """``img`` decoded, in the mode for ``channels``."""
    if channels is not None:
        mode = MODES[channels]
    elif img.mode in ("L", "RGB", "RGBA"):
        mode = img.mode
    else:
        mode = "RGBA" if img.mode in ("LA", "PA") or "transparency" in img.info else "RGB"
    try:
        img.load()
        return img if img.mode == mode else img.convert(mode)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise _decode_error(None, error) from None


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    array = np.asarray(data)
    if array.dtype.kind == "S" or (array.dtype == object and array.ndim == 0):
        return bytes(array.item())
    if array.dtype == np.uint8 and array.ndim == 1:
        return array.tobytes()
    raise ValueError(
        f"Expected encoded image bytes (bytes, np.bytes_ or a 1-D uint8 buffer), got "
        f"{type(data).__name__} with shape {np.shape(data)} and dtype {array.dtype}. Pass "
        "decoded images as (height, width, channels) uint8 arrays to the array operations."
    )


def _decode_error(raw: bytes | None, error: BaseException) -> ValueError:
    start = "" if raw is None else f" ({len(raw)} bytes, starting {raw[:8]!r})"
    return ValueError(
        f"Could not decode image bytes{start}: expected a complete JPEG or PNG file "
        f"({type(error).__name__}: {error}). Check that the field holds the encoded file, "
        "not raw pixels or a truncated copy."
    )


def encode(
    image: np.ndarray, *, format: Literal["jpeg", "png"] = "jpeg", quality: int = 90
) -> bytes:
    """Encodes a ``uint8`` image as JPEG (lossy, ``quality`` 1-95) or PNG (lossless).

    Examples:
        >>> data = encode(np.zeros((8, 8, 3), np.uint8))
        >>> data[:2], decode(data).shape
        (b'\\xff\\xd8', (8, 8, 3))
    """
    array = check_image(image)
    if array.dtype != np.uint8:
        raise ValueError(f"encode expects a uint8 image, got dtype {array.dtype}.")
    fmt = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG"}.get(str(format).lower())
    if fmt is None:
        raise ValueError(f"format must be 'jpeg' or 'png', got {format!r}.")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in [1, 100], got {quality!r}.")
    channels = array.shape[2]
    if channels not in MODES or (fmt == "JPEG" and channels == 4):
        allowed = "1 or 3" if fmt == "JPEG" else "1, 3 or 4"
        raise ValueError(f"{fmt} images need {allowed} channels, got {channels}.")
    buffer = io.BytesIO()
    options = {"quality": int(quality)} if fmt == "JPEG" else {}
    _pil(array).save(buffer, format=fmt, **options)
    return buffer.getvalue()


# ---------------------------------------------------------------------- geometry


def _pil(array: np.ndarray) -> Image.Image:
    return Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)


def _resize_box(
    array: np.ndarray,
    box: tuple[float, float, float, float],
    out_hw: tuple[int, int],
    resample: Image.Resampling,
) -> np.ndarray:
    """The ``(top, left, height, width)`` region of ``array`` resized to ``out_hw``."""
    top, left, height, width = box
    if (height, width) == out_hw and float(top).is_integer() and float(left).is_integer():
        top, left = int(top), int(left)
        return array[top : top + out_hw[0], left : left + out_hw[1]]
    if array.dtype != np.uint8:
        raise ValueError(f"resizing expects a uint8 image, got dtype {array.dtype}.")
    return _resize_pil(_pil(array), box, out_hw, resample)


def _resize_pil(
    img: Image.Image,
    box: tuple[float, float, float, float],
    out_hw: tuple[int, int],
    resample: Image.Resampling,
) -> np.ndarray:
    top, left, height, width = box
    pil_box = (left, top, left + width, top + height)
    out = np.asarray(img.resize((out_hw[1], out_hw[0]), resample, box=pil_box))
    return out[:, :, None] if out.ndim == 2 else out


def resize(image: np.ndarray, size: Size, *, resample: Resample = "bilinear") -> np.ndarray:
    """Resizes a ``uint8`` image to ``size`` (antialiased when shrinking).

    Examples:
        >>> resize(np.zeros((10, 20, 3), np.uint8), (5, 8)).shape
        (5, 8, 3)
    """
    array = check_image(image)
    height, width = array.shape[:2]
    return _resize_box(array, (0, 0, height, width), as_hw(size), check_resample(resample))


def random_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> Box:
    """An Inception-style random crop box ``(top, left, height, width)``.

    Each attempt draws an area fraction uniformly from ``scale`` and an aspect ratio
    (width / height) log-uniformly from ``ratio``; the first box that fits is placed
    uniformly at random. If none fits, the box is the largest centred one whose aspect
    ratio lies in ``ratio``. The draws depend only on the image's size and ``rng``.

    Examples:
        >>> top, left, h, w = random_crop_box(100, 200, np.random.default_rng(0))
        >>> 0 <= top <= 100 - h and 0 <= left <= 200 - w
        True
    """
    low, high = check_range(scale, name="scale")
    log_ratio = _log_range(check_range(ratio, name="ratio"))
    area = height * width
    for _ in range(attempts):
        target = area * rng.uniform(low, high)
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < h <= height and 0 < w <= width:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    h, w = centred_box_size(height, width, (math.exp(log_ratio[0]), math.exp(log_ratio[1])))
    return (height - h) // 2, (width - w) // 2, h, w


def centred_box_size(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """``random_crop_box``'s fallback size: the whole image, its aspect clamped to ``ratio``.

    Examples:
        >>> centred_box_size(100, 400, (3 / 4, 4 / 3))
        (100, 133)
    """
    aspect = width / height
    if aspect < ratio[0]:
        return max(1, round(width / ratio[0])), width
    if aspect > ratio[1]:
        return height, max(1, round(height * ratio[1]))
    return height, width


@functools.lru_cache(maxsize=8)
def _log_range(ratio: tuple[float, float]) -> tuple[float, float]:
    low, high = np.log(ratio)  # numpy's log, as the crop boxes were always drawn with
    return float(low), float(high)


def random_resized_crop(
    image: np.ndarray,
    size: Size,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
    resample: Resample = "bilinear",
) -> np.ndarray:
    """A random crop (``random_crop_box``) resized to ``size``, in one resampling pass.

    Examples:
        >>> pixels = np.zeros((64, 48, 3), np.uint8)
        >>> random_resized_crop(pixels, 32, np.random.default_rng(0)).shape
        (32, 32, 3)
    """
    array = check_image(image)
    out_hw, method = as_hw(size), check_resample(resample)
    height, width = array.shape[:2]
    box = random_crop_box(height, width, rng, scale=scale, ratio=ratio, attempts=attempts)
    return _resize_box(array, box, out_hw, method)


def decode_and_random_crop(
    data: Encoded,
    size: Size,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
    resample: Resample = "bilinear",
    channels: int | None = 3,
) -> np.ndarray:
    """``random_resized_crop(decode(data), ...)`` without resampling the full image twice.

    The crop box is drawn from the file's header size (the same draws as
    ``random_resized_crop`` on the decoded image). A JPEG whose crop shrinks by 2× or
    more is decoded at reduced scale (Pillow's ``draft``: libjpeg scales in the DCT,
    by 1/2, 1/4 or 1/8), so less is decoded and resampled; the result then differs
    slightly from the full-scale path. PNGs are decoded in full.

    Raises:
        ValueError: ``data`` is not a JPEG or PNG file (see ``decode``).

    Examples:
        >>> data = encode(np.zeros((600, 400, 3), np.uint8))
        >>> decode_and_random_crop(data, 64, np.random.default_rng(0)).shape
        (64, 64, 3)
    """
    out_hw, method = as_hw(size), check_resample(resample)
    with _open(data, channels) as img:
        width, height = img.size
        top, left, h, w = random_crop_box(
            height, width, rng, scale=scale, ratio=ratio, attempts=attempts
        )
        if img.format == "JPEG":
            shrink = min(h / out_hw[0], w / out_hw[1])
            if shrink >= 2:
                mode = MODES[channels] if channels in (1, 3) else img.mode
                img.draft(mode, (math.ceil(width / shrink), math.ceil(height / shrink)))
        fy, fx = img.size[1] / height, img.size[0] / width
        box = (top * fy, left * fx, h * fy, w * fx)
        if (fy, fx, h, w) == (1, 1, *out_hw):  # nothing to resample: slice
            return _to_array(img, channels)[top : top + h, left : left + w]
        return _resize_pil(_loaded(img, channels), box, out_hw, method)


def random_crop(
    image: np.ndarray, size: Size, rng: np.random.Generator, *, padding: int = 0
) -> np.ndarray:
    """A ``size`` crop at a uniformly random place of the image zero-padded by ``padding``.

    With ``padding=4`` and ``size=32`` on 32×32 images, the standard CIFAR augmentation.

    Examples:
        >>> random_crop(np.ones((32, 32, 3), np.uint8), 32, np.random.default_rng(0),
        ...             padding=4).shape
        (32, 32, 3)
    """
    array = check_image(image)
    out_h, out_w = as_hw(size)
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding!r}.")
    height, width = array.shape[0] + 2 * padding, array.shape[1] + 2 * padding
    if out_h > height or out_w > width:
        raise ValueError(
            f"random_crop of size {(out_h, out_w)} does not fit in the image of shape "
            f"{array.shape[:2]} padded by {padding}; pass a smaller size or more padding."
        )
    top = int(rng.integers(0, height - out_h + 1))
    left = int(rng.integers(0, width - out_w + 1))
    if padding:
        array = np.pad(array, ((padding, padding), (padding, padding), (0, 0)))
    return array[top : top + out_h, left : left + out_w]


def center_crop(
    image: np.ndarray,
    size: Size,
    *,
    crop_fraction: float = 0.875,
    resample: Resample = "bilinear",
) -> np.ndarray:
    """The usual evaluation crop: resize the shorter side to ``size / crop_fraction``,
    then take the central ``size``, in one resampling pass.

    Equivalently, the central region of ``crop_fraction`` times the shorter side (of
    ``size``'s aspect ratio) is resized to ``size``; an image whose central region
    already has that size is sliced, not resampled (``crop_fraction=1`` keeps an image
    of size ``size`` as it is).

    Examples:
        >>> pixels = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
        >>> np.array_equal(center_crop(pixels, 56), pixels[4:60, 4:60])
        True
    """
    array = check_image(image)
    out_h, out_w = as_hw(size)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}.")
    height, width = array.shape[:2]
    # The resize factor that maps the shorter side to (shorter output side) / crop_fraction.
    factor = min(out_h, out_w) / crop_fraction / min(height, width)
    h, w = min(out_h / factor, height), min(out_w / factor, width)
    box = ((height - h) / 2, (width - w) / 2, h, w)
    return _resize_box(array, box, (out_h, out_w), check_resample(resample))


def horizontal_flip(image: np.ndarray, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """``image[:, ::-1]`` with probability ``p``, else ``image``; always one draw from ``rng``.

    Examples:
        >>> pixels = np.arange(6, dtype=np.uint8).reshape(1, 3, 2)
        >>> horizontal_flip(pixels, np.random.default_rng(0), p=1.0)[0, :, 0].tolist()
        [4, 2, 0]
    """
    if not 0 <= p <= 1:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}.")
    array = check_image(image)
    return array[:, ::-1] if rng.random() < p else array


def normalize(image: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """``(image / 255 - mean) / std`` as float32, per channel.

    ``mean`` and ``std`` are in [0, 1] units (``IMAGENET_MEAN``, ``IMAGENET_STD``): a
    ``uint8`` image is scaled by 1/255 first; a float image is taken as already in
    [0, 1].

    Examples:
        >>> normalize(np.full((1, 1, 3), 255, np.uint8), (0.5,) * 3, (0.5,) * 3).tolist()
        [[[1.0, 1.0, 1.0]]]
    """
    return _normalized(check_image(image), mean, std)


def normalize_batch(images: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """``normalize`` of each image of a ``(batch, height, width, channels)`` array, at once.

    The same arithmetic as ``normalize``, element by element, so the results are equal.

    Examples:
        >>> batch = np.full((2, 1, 1, 3), 255, np.uint8)
        >>> normalize_batch(batch, (0.5,) * 3, (0.5,) * 3).shape
        (2, 1, 1, 3)
    """
    array = np.asarray(images)
    if array.ndim != 4:
        raise ValueError(
            f"images must be a (batch, height, width, channels) array, got shape {array.shape}."
        )
    return _normalized(array, mean, std)


def _normalized(array: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """float32 ``(array / 255 - mean) / std`` over the last (channel) axis (no /255 for
    floats), as ``array * (unit / std) - mean / std`` in float32: ``normalize``'s and
    ``normalize_batch``'s one arithmetic."""
    mean32, std32 = channel_stats(mean, std, array.shape[-1])
    unit = 1 / 255 if array.dtype == np.uint8 else 1.0
    out = array.astype(np.float32)
    scale, offset = (unit / std32).astype(np.float32), (mean32 / std32).astype(np.float32)
    # Per-channel values repeated along a row: numpy's inner loop then runs over whole
    # rows instead of the 3 channels (7x faster on a batch; the same values).
    rows = out.reshape(-1, out.shape[-2] * out.shape[-1])  # an image or a batch of them
    repeat = rows.shape[-1] // scale.size
    rows *= np.tile(scale, repeat)
    rows -= np.tile(offset, repeat)
    return out


def channel_stats(mean: Any, std: Any, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """``mean`` and ``std`` as float64 vectors of 1 or ``channels`` values, ``std`` > 0."""
    mean32 = np.asarray(mean, np.float64).reshape(-1)
    std32 = np.asarray(std, np.float64).reshape(-1)
    for name, value in (("mean", mean32), ("std", std32)):
        if value.size not in (1, channels):
            raise ValueError(
                f"{name} has {value.size} values but the image has {channels} channels; "
                f"pass one value per channel (or one for all), e.g. IMAGENET_MEAN for RGB."
            )
    if np.any(std32 <= 0):
        raise ValueError(f"std must be positive, got {std!r}.")
    return mean32, std32
