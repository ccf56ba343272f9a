"""Picklable per-example transforms for image classification, built from the operations.

``train_transform`` and ``eval_transform`` assemble the usual classification transforms
as small frozen dataclasses: they pickle, so Grain worker processes can run them. Each
takes a record ``{"image": encoded bytes or uint8 array, "label": ...}``; random draws
come from the pipeline's per-example generator, in a fixed order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshkit.data._source import Record, stack_records
from meshkit.data.image._ops import (
    MODES,
    Resample,
    Size,
    as_hw,
    center_crop,
    channel_stats,
    check_image,
    check_range,
    check_resample,
    decode,
    decode_and_random_crop,
    normalize,
    normalize_batch,
    random_crop,
    random_resized_crop,
)


def _image_array(value: Any) -> np.ndarray | None:
    """A decoded image array, or ``None`` if ``value`` holds encoded bytes."""
    if isinstance(value, bytes | bytearray | memoryview):
        return None
    array = np.asarray(value)
    if array.dtype.kind == "S" or array.dtype == object or array.ndim == 1:
        return None
    return check_image(array)


def _label(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {"label": np.asarray(record["label"], np.int32)} if "label" in record else {}


@dataclasses.dataclass(frozen=True)
class TrainTransform:
    """The training transform: random crop, horizontal flip, normalise; see ``train_transform``."""

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    padding: int | None = None
    flip: float = 0.5
    resample: Resample = "bilinear"
    channels: int | None = 3

    def __call__(self, record: Mapping[str, Any], rng: np.random.Generator) -> Record:
        array, flip = self._crop(record, rng)
        image = normalize(array[:, ::-1] if flip else array, self.mean, self.std)
        return {**record, "image": image, **_label(record)}

    def batch(
        self, records: Sequence[Mapping[str, Any]], rngs: Sequence[np.random.Generator]
    ) -> Record:
        """Every record cropped and flipped, stacked, its images still ``uint8``: the
        transform of every record is ``finish(batch(records, rngs))``, equal to
        ``stack_records(map(self, ...))`` pixel for pixel (tested).

        Decoding and cropping stay per example (with the same random draws, in the same
        order); flips run once over the stacked batch and ``finish`` normalises it,
        which saves most of the per-example overhead for small images. A pipeline's
        worker processes stop before ``finish`` and send ``uint8`` batches, a quarter
        of the bytes; the process that trains finishes them.
        """
        crops = [self._crop(record, rng) for record, rng in zip(records, rngs, strict=True)]
        pixels = np.stack([array for array, _ in crops])
        flips = np.fromiter((flip for _, flip in crops), bool, len(crops))
        if flips.any():
            pixels[flips] = pixels[flips, :, ::-1]
        batch = {"image": pixels}
        rest = [{k: v for k, v in record.items() if k != "image"} for record in records]
        rest = [{**record, **_label(record)} for record in rest]
        if rest and rest[0]:
            batch |= stack_records(rest)
        return batch

    def finish(self, batch: Record) -> Record:
        """``batch``'s images normalised: float32 ``(image / 255 - mean) / std``."""
        return {**batch, "image": normalize_batch(batch["image"], self.mean, self.std)}

    def _crop(self, record: Mapping[str, Any], rng: np.random.Generator) -> tuple[np.ndarray, bool]:
        """The cropped image (before flip and normalisation) and the flip drawn for it."""
        value = record["image"]
        array = _image_array(value)
        if self.padding is not None:
            if array is None:
                array = decode(value, channels=self.channels)
            array = random_crop(array, self.size, rng, padding=self.padding)
        elif array is None:
            array = decode_and_random_crop(
                value,
                self.size,
                rng,
                scale=self.scale,
                ratio=self.ratio,
                resample=self.resample,
                channels=self.channels,
            )
        else:
            array = random_resized_crop(
                array, self.size, rng, scale=self.scale, ratio=self.ratio, resample=self.resample
            )
        return array, bool(rng.random() < self.flip)  # horizontal_flip's one draw


@dataclasses.dataclass(frozen=True)
class EvalTransform:
    """The evaluation transform: centre crop, normalise; see ``eval_transform``."""

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_fraction: float = 0.875
    resample: Resample = "bilinear"
    channels: int | None = 3

    def __call__(self, record: Mapping[str, Any]) -> Record:
        value = record["image"]
        array = _image_array(value)
        if array is None:
            array = decode(value, channels=self.channels)
        array = center_crop(
            array, self.size, crop_fraction=self.crop_fraction, resample=self.resample
        )
        return {**record, "image": normalize(array, self.mean, self.std), **_label(record)}


def _floats(values: Any, *, name: str) -> tuple[float, ...]:
    try:
        result = tuple(float(v) for v in np.asarray(values, np.float64).reshape(-1))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}.") from None
    if not result:
        raise ValueError(f"{name} must hold at least one value, got {values!r}.")
    return result


def _check_channels(channels: int | None, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    if channels is not None and channels not in MODES:
        raise ValueError(f"channels must be 1, 3, 4 or None, got {channels!r}.")
    if channels is not None:
        channel_stats(mean, std, channels)
    elif min(std) <= 0:
        raise ValueError(f"std must be positive, got {std!r}.")


def train_transform(
    size: Size,
    *,
    mean: Any,
    std: Any,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    padding: int | None = None,
    flip: float = 0.5,
    resample: Resample = "bilinear",
    channels: int | None = 3,
) -> TrainTransform:
    """The classification training transform, for ``TrainPipeline(transform=...)``.

    Takes a record ``{"image": encoded bytes or uint8 array, "label": ...}`` and returns
    it with ``"image"`` a float32 ``(height, width, channels)`` array and ``"label"``
    int32 (other fields pass through). The crop is Inception-style
    (``random_resized_crop`` with ``scale`` and ``ratio``; JPEG bytes go through
    ``decode_and_random_crop``), or, with ``padding`` set, the CIFAR-style
    ``random_crop`` of the image zero-padded by ``padding``. Then a horizontal flip
    with probability ``flip``, and ``normalize`` with ``mean`` and ``std`` (in [0, 1]
    units, e.g. ``IMAGENET_MEAN``, ``CIFAR10_MEAN``).

    Bytes are decoded to ``channels`` (see ``decode``); arrays keep their channels.
    The result is a frozen dataclass: it pickles, so Grain worker processes can run it.

    Examples:
        >>> import pickle
        >>> from meshkit.data.image import CIFAR10_MEAN, CIFAR10_STD
        >>> transform = train_transform(32, mean=CIFAR10_MEAN, std=CIFAR10_STD, padding=4)
        >>> pickle.loads(pickle.dumps(transform)) == transform
        True
    """
    mean_t, std_t = _floats(mean, name="mean"), _floats(std, name="std")
    _check_channels(channels, mean_t, std_t)
    fields = _augmentation(
        size, mean=mean_t, std=std_t, scale=scale, ratio=ratio, padding=padding, flip=flip
    )
    check_resample(resample)
    return TrainTransform(**fields, resample=resample, channels=channels)


def _augmentation(
    size: Size,
    *,
    mean: Any,
    std: Any,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    padding: int | None,
    flip: float,
) -> dict[str, Any]:
    """The checked fields a training augmentation shares, on the host
    (``train_transform``) or on the device (``device_augmentation``)."""
    if padding is not None and (isinstance(padding, bool) or padding < 0):
        raise ValueError(f"padding must be None or an int >= 0, got {padding!r}.")
    if not 0 <= flip <= 1:
        raise ValueError(f"flip must be a probability in [0, 1], got {flip!r}.")
    return {
        "size": as_hw(size),
        "mean": _floats(mean, name="mean"),
        "std": _floats(std, name="std"),
        "scale": check_range(scale, name="scale"),
        "ratio": check_range(ratio, name="ratio"),
        "padding": None if padding is None else int(padding),
        "flip": float(flip),
    }


def eval_transform(
    size: Size,
    *,
    mean: Any,
    std: Any,
    crop_fraction: float = 0.875,
    resample: Resample = "bilinear",
    channels: int | None = 3,
) -> EvalTransform:
    """The classification evaluation transform, for ``EvalPipeline(transform=...)``.

    ``center_crop`` (pass ``crop_fraction=1`` to keep small images such as CIFAR's
    whole), then ``normalize``; records as in ``train_transform``.

    Examples:
        >>> from meshkit.data.image import CIFAR10_MEAN, CIFAR10_STD
        >>> transform = eval_transform(32, mean=CIFAR10_MEAN, std=CIFAR10_STD, crop_fraction=1)
        >>> record = {"image": np.zeros((32, 32, 3), np.uint8), "label": np.int64(1)}
        >>> transform(record)["image"].shape
        (32, 32, 3)
    """
    mean_t, std_t = _floats(mean, name="mean"), _floats(std, name="std")
    _check_channels(channels, mean_t, std_t)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction!r}.")
    check_resample(resample)
    return EvalTransform(
        size=as_hw(size),
        mean=mean_t,
        std=std_t,
        crop_fraction=float(crop_fraction),
        resample=resample,
        channels=channels,
    )
