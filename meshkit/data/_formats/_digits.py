"""The embedded default data set (scikit-learn's 8×8 digits) and synthetic data.

Both work offline: the digits ship inside scikit-learn's wheel and synthetic data is
drawn from a seeded generator.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from meshkit.data._source import ArraySource

NUM_DIGITS = 1797
"""Examples in scikit-learn's digits set."""

NUM_DIGITS_TEST = 360
"""Examples in the fixed test split; the other 1,437 are the training split."""

_SPLIT_SEED = 0


@functools.cache
def _base_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as float32 ``[N, 8, 8]`` in [0, 1] and int32 labels (read-only)."""
    data_Nx65 = np.loadtxt(_digits_file(), delimiter=",")  # 64 pixels in 0..16, the label
    images = (data_Nx65[:, :64].reshape(-1, 8, 8) / 16.0).astype(np.float32)
    labels = data_Nx65[:, 64].astype(np.int32)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


def _digits_file() -> Path:
    """The digits file inside scikit-learn's installed package, found without importing
    ``sklearn.datasets`` (about 2 s of imports that ``load_digits`` would add to every
    process reading the digits)."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError, AttributeError):  # a None or broken sys.modules entry
        spec = None
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    where = f" (no sklearn/datasets/data/digits.csv.gz in {folders})" if folders else ""
    raise ImportError(
        f"meshkit.data.digits needs scikit-learn, whose wheel ships the 8×8 digits set{where}; "
        "install it with `pip install scikit-learn` or `pip install meshkit[recipes]`."
    )


@functools.cache
def _split_indices(split: str) -> np.ndarray:
    order = np.random.default_rng(_SPLIT_SEED).permutation(NUM_DIGITS)
    cut = NUM_DIGITS - NUM_DIGITS_TEST
    return order[:cut] if split == "train" else order[cut:]


def interpolation_matrix(size_in: int, size_out: int) -> np.ndarray:
    """The ``[size_out, size_in]`` matrix of 1-D linear interpolation (half-pixel centres).

    Output pixel ``i`` samples the input at ``(i + 0.5) * size_in / size_out - 0.5``,
    clamped to ``[0, size_in - 1]`` (edge pixels repeat). This is the convention of
    ``jax.image.resize(..., method="linear")`` and of
    ``scipy.ndimage.zoom(..., order=1, grid_mode=True, mode="nearest")`` when enlarging.
    Rows sum to one, so a constant image stays constant.

    Examples:
        >>> interpolation_matrix(2, 4).tolist()
        [[1.0, 0.0], [0.75, 0.25], [0.25, 0.75], [0.0, 1.0]]
        >>> import numpy as np
        >>> [bool(np.allclose(interpolation_matrix(n, m).sum(axis=1), 1.0))
        ...  for n, m in ((8, 28), (8, 32), (5, 3))]
        [True, True, True]
        >>> bool((interpolation_matrix(8, 8) == np.eye(8)).all())
        True
    """
    if size_in < 1 or size_out < 1:
        raise ValueError(f"Sizes must be positive; got size_in={size_in}, size_out={size_out}.")
    position = (np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5
    position = np.clip(position, 0, size_in - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, size_in - 1)
    fraction = position - low
    matrix = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    np.add.at(matrix, (rows, low), 1.0 - fraction)
    np.add.at(matrix, (rows, high), fraction)
    return matrix


def resize_bilinear(images_NxHxW: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinearly resizes a stack of 2-D images: ``out = Wr @ image @ Wc.T`` per image.

    Uses :func:`interpolation_matrix` along rows and columns (half-pixel centres).

    Examples:
        >>> import numpy as np
        >>> resize_bilinear(np.ones((1, 8, 8), np.float32), 28, 28).shape
        (1, 28, 28)
        >>> constant = resize_bilinear(np.full((2, 8, 8), 0.37, np.float32), 28, 32)
        >>> bool(np.allclose(constant, 0.37))
        True
    """
    images_NxHxW = np.asarray(images_NxHxW)
    if images_NxHxW.ndim != 3:
        raise ValueError(f"Expected images of shape [N, H, W]; got {images_NxHxW.shape}.")
    rows_RxH = interpolation_matrix(images_NxHxW.shape[1], height)
    cols_CxW = interpolation_matrix(images_NxHxW.shape[2], width)
    out = np.einsum("rh,nhw,cw->nrc", rows_RxH, images_NxHxW, cols_CxW, optimize=True)
    return out.astype(images_NxHxW.dtype, copy=False)


@functools.cache
def _sized_digits(image_size: int) -> np.ndarray:
    images, _ = _base_digits()
    if image_size == images.shape[1]:
        return images
    resized = resize_bilinear(images, image_size, image_size)
    resized.flags.writeable = False
    return resized


def digits(
    split: Literal["train", "test"],
    *,
    image_size: Literal[8, 28, 32] = 8,
    channels: Literal[1, 3] = 1,
) -> ArraySource:
    """scikit-learn's 1,797 real 8×8 handwritten digits: meshkit's offline default data.

    The split is fixed: ``np.random.default_rng(0).permutation(1797)`` orders the
    examples, the first 1,437 are ``"train"`` and the last 360 are ``"test"``. Images
    are float32 in [0, 1] (raw values 0..16 divided by 16) of shape
    ``[image_size, image_size, channels]`` in field ``"image"``; labels are int32 in
    ``"label"``. ``image_size`` 28 or 32 enlarges bilinearly with half-pixel centres
    (see :func:`interpolation_matrix`) so models built for MNIST (28×28×1) or CIFAR
    (32×32×3) run unchanged; ``channels=3`` repeats the gray channel. Loaded arrays are
    cached, so repeated calls are cheap.

    Args:
        split: ``"train"`` (1,437 examples) or ``"test"`` (360 examples).
        image_size: Height and width of the returned images: 8, 28 or 32.
        channels: 1 (gray) or 3 (gray repeated as RGB).

    Returns:
        An :class:`ArraySource` whose fingerprint depends on split, size and channels.

    Raises:
        ImportError: scikit-learn is not installed.
        ValueError: An argument is outside the values above.

    Examples:
        >>> source = digits("test", image_size=28)
        >>> len(source), source[0]["image"].shape, source[0]["image"].dtype
        (360, (28, 28, 1), dtype('float32'))
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
    if image_size not in (8, 28, 32):
        raise ValueError(f"image_size must be 8, 28 or 32; got {image_size!r}.")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3; got {channels!r}.")
    index = _split_indices(split)
    images_NxHxW = _sized_digits(image_size)[index]
    images_NxHxWxC = np.repeat(images_NxHxW[..., None], channels, axis=-1)
    labels_N = _base_digits()[1][index]
    name = f"digits-{split}-{image_size}x{image_size}x{channels}"
    return ArraySource({"image": images_NxHxWxC, "label": labels_N}, name=name, num_classes=10)


def synthetic(
    num_examples: int,
    image_shape: tuple[int, ...] = (32, 32, 3),
    *,
    num_classes: int = 10,
    seed: int = 0,
    dtype: npt.DTypeLike = np.uint8,
) -> ArraySource:
    """Random images and labels for benchmarks: deterministic for a given ``seed``.

    Integer dtypes draw images uniformly over ``[0, 255]`` (clipped to the dtype's
    range); floating dtypes draw from ``[0, 1)``. Labels are int32 in
    ``[0, num_classes)``. The default uint8 keeps large benchmark sets small.

    Args:
        num_examples: Number of examples (at least 1).
        image_shape: Shape of one image, e.g. ``(32, 32, 3)``.
        num_classes: Labels are drawn from ``range(num_classes)``.
        seed: Seed of ``np.random.default_rng``.
        dtype: Image dtype.

    Returns:
        An :class:`ArraySource` with fields ``"image"`` and ``"label"``.

    Examples:
        >>> source = synthetic(4, (8, 8, 1))
        >>> len(source), source[0]["image"].dtype, source[0]["label"].dtype
        (4, dtype('uint8'), dtype('int32'))
    """
    if num_examples < 1 or num_classes < 1:
        raise ValueError(
            f"num_examples and num_classes must be positive; got {num_examples}, {num_classes}."
        )
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    shape = (num_examples, *image_shape)
    if np.issubdtype(dtype, np.integer):
        high = min(255, int(np.iinfo(dtype).max))
        images = rng.integers(0, high, size=shape, dtype=dtype, endpoint=True)
    elif np.issubdtype(dtype, np.floating):
        images = rng.random(shape, dtype=np.float32).astype(dtype, copy=False)
    else:
        raise ValueError(f"dtype must be an integer or floating dtype; got {dtype}.")
    labels = rng.integers(0, num_classes, size=num_examples, dtype=np.int32)
    shape_text = "x".join(map(str, image_shape))
    name = f"synthetic-{num_examples}-{shape_text}-{dtype.name}-c{num_classes}-s{seed}"
    return ArraySource({"image": images, "label": labels}, name=name, num_classes=num_classes)
