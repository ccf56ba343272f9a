"""Augmentation on the accelerator: the host decodes, the train step crops, flips and
normalises the uint8 batch inside its jit.

For small images the host's cost per image is mostly Python's own work around the
decode (the crop's draws, the flip, the normalisation, one float32 image each), and a
uint8 image is a quarter of the float32 one to ship. ``decode_transform`` leaves the host
only the decode; ``DeviceAugmentation`` does the rest for the whole global batch as a
few array operations, traced into the train step (``augmentation.wrap(loss_fn)``).

The random draws come from the step's key (``state.step_rng()``): a resumed run draws
what the uninterrupted one drew, and, with JAX's partitionable random bits, the draws
of a row do not depend on how the batch is sharded (1×8 and 2×4 see the same crops).
The crops follow the host transform's distribution (``random_crop_box``'s rule, the
same ``scale`` and ``ratio``, first fitting attempt of ten, a centre crop otherwise),
resampled with ``jax.image.scale_and_translate`` (linear, antialiased) rather than
PIL: the same kind of crop, not the same pixels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.data._source import Record, stack_records
from meshkit.data.image._ops import (
    MODES,
    Size,
    as_hw,
    centred_box_size,
    channel_stats,
    decode,
    resize,
)
from meshkit.data.image._transforms import _augmentation, _image_array, _label

_ATTEMPTS = 10  # random_crop_box's attempts before its centre-crop fallback


@dataclasses.dataclass(frozen=True)
class DecodeTransform:
    """The host's part of on-device augmentation: decode to uint8; see ``decode_transform``."""

    size: tuple[int, int] | None = None
    channels: int = 3
    deterministic: ClassVar[bool] = True  # nothing drawn: a resident pipeline runs it once

    def __call__(self, record: Mapping[str, Any], rng: Any = None) -> Record:
        del rng  # nothing random on the host
        value = record["image"]
        array = _image_array(value)
        if array is None:
            array = decode(value, channels=self.channels)
        if self.size is not None and array.shape[:2] != self.size:
            array = resize(array, self.size)
        return {**record, "image": array, **_label(record)}

    def batch(self, records: Sequence[Mapping[str, Any]], rngs: Sequence[Any]) -> Record:
        """Every record decoded, stacked into one uint8 batch."""
        del rngs
        return stack_records([self(record) for record in records])


def decode_transform(size: Size | None = None, *, channels: int = 3) -> DecodeTransform:
    """A ``TrainPipeline`` transform that only decodes: uint8 images, for augmentation on
    the device (``DeviceAugmentation``).

    JPEG/PNG bytes are decoded to ``channels``; arrays pass as they are. ``size``
    resizes images whose size differs (a batch needs one shape; the device's crop
    then works on that). Labels become int32. The transform builds whole batches, so
    Grain's threads and workers take batches, not examples.

    Examples:
        >>> import numpy as np
        >>> from meshkit.data.image import encode
        >>> record = {"image": encode(np.zeros((32, 32, 3), np.uint8)), "label": 3}
        >>> out = decode_transform()(record)
        >>> out["image"].dtype, out["image"].shape, out["label"].dtype
        (dtype('uint8'), (32, 32, 3), dtype('int32'))
    """
    if channels not in MODES:
        raise ValueError(f"channels must be 1, 3 or 4, got {channels!r}.")
    return DecodeTransform(size=None if size is None else as_hw(size), channels=channels)


@dataclasses.dataclass(frozen=True)
class DeviceAugmentation:
    """Random crop, horizontal flip and normalisation of a uint8 image batch, in jit.

    Call it as ``augmentation(images, key)`` on a ``(batch, height, width, channels)``
    uint8 array to get float32 ``(batch, *size, channels)`` images, or let
    ``augmentation.wrap(loss_fn)`` do that to ``batch["image"]`` inside the train step.
    Build it with ``device_augmentation``.
    """

    size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    padding: int | None = None
    flip: float = 0.5

    def __call__(self, images: jax.Array, key: jax.Array) -> jax.Array:
        if images.ndim != 4:
            raise ValueError(
                "DeviceAugmentation takes a (batch, height, width, channels) batch of "
                f"images, got shape {images.shape}; decode on the host with "
                "decode_transform() so the pipeline yields whole uint8 batches."
            )
        crop_key, flip_key = jax.random.split(key)
        if self.padding is None:
            pixels = self._resized_crops(images, crop_key)
        else:
            pixels = self._padded_crops(images, crop_key)
        flips = jax.random.uniform(flip_key, (images.shape[0],)) < self.flip
        pixels = jnp.where(flips[:, None, None, None], pixels[:, :, ::-1], pixels)
        mean, std = channel_stats(self.mean, self.std, images.shape[3])
        unit = 1 / 255 if images.dtype == jnp.uint8 else 1.0
        scale = jnp.asarray(unit / std, jnp.float32)
        return pixels * scale - jnp.asarray(mean / std, jnp.float32)

    def _resized_crops(self, images: jax.Array, key: jax.Array) -> jax.Array:
        """``random_crop_box``'s boxes, drawn for the whole batch, each resized to ``size``."""
        batch, height, width, channels = images.shape
        area_key, ratio_key, top_key, left_key = jax.random.split(key, 4)
        shape = (batch, _ATTEMPTS)
        area = (
            height
            * width
            * jax.random.uniform(area_key, shape, minval=self.scale[0], maxval=self.scale[1])
        )
        log_low, log_high = np.log(self.ratio)
        aspect = jnp.exp(jax.random.uniform(ratio_key, shape, minval=log_low, maxval=log_high))
        w = jnp.round(jnp.sqrt(area * aspect))
        h = jnp.round(jnp.sqrt(area / aspect))
        fits = (h > 0) & (h <= height) & (w > 0) & (w <= width)
        first = jnp.argmax(fits, axis=1)
        found = jnp.any(fits, axis=1)
        rows = jnp.arange(batch)
        fallback_h, fallback_w = centred_box_size(height, width, self.ratio)
        h = jnp.where(found, h[rows, first], fallback_h)
        w = jnp.where(found, w[rows, first], fallback_w)
        top = jnp.where(
            found,
            jnp.floor(jax.random.uniform(top_key, (batch,)) * (height - h + 1)),
            (height - h) // 2,
        )
        left = jnp.where(
            found,
            jnp.floor(jax.random.uniform(left_key, (batch,)) * (width - w + 1)),
            (width - w) // 2,
        )
        out_h, out_w = self.size

        def crop(image: jax.Array, top: jax.Array, left: jax.Array, h: jax.Array, w: jax.Array):
            scale = jnp.stack([out_h / h, out_w / w])
            return jax.image.scale_and_translate(
                image.astype(jnp.float32),
                (out_h, out_w, channels),
                spatial_dims=(0, 1),
                scale=scale,
                translation=-jnp.stack([top, left]) * scale,
                method="linear",
                antialias=True,
            )

        return jax.vmap(crop)(images, top, left, h, w)

    def _padded_crops(self, images: jax.Array, key: jax.Array) -> jax.Array:
        """CIFAR-style crops: ``size`` windows of the image zero-padded by ``padding``."""
        batch, height, width, _ = images.shape
        pad = int(self.padding or 0)
        out_h, out_w = self.size
        if out_h > height + 2 * pad or out_w > width + 2 * pad:
            raise ValueError(
                f"crop size {self.size} is larger than the padded images "
                f"({height + 2 * pad}, {width + 2 * pad}); lower size or raise padding."
            )
        padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        top_key, left_key = jax.random.split(key)
        top = jax.random.randint(top_key, (batch,), 0, height + 2 * pad - out_h + 1)
        left = jax.random.randint(left_key, (batch,), 0, width + 2 * pad - out_w + 1)

        def crop(image: jax.Array, top: jax.Array, left: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice(image, (top, left, 0), (out_h, out_w, image.shape[2]))

        return jax.vmap(crop)(padded, top, left).astype(jnp.float32)

    def wrap(self, loss_fn: Any) -> Any:
        """``loss_fn`` with ``batch["image"]`` augmented first, from a key of its own
        folded out of the step's key (the loss's other draws, such as dropout, are
        unchanged)."""

        def augmented_loss(params: Any, state: Any, batch: Any, rng: jax.Array) -> Any:
            images = self(batch["image"], jax.random.fold_in(rng, _AUGMENT_STREAM))
            return loss_fn(params, state, {**batch, "image": images}, rng)

        return augmented_loss


_AUGMENT_STREAM = 0x617567  # "aug": the step key's stream for augmentation


def device_augmentation(
    size: Size,
    *,
    mean: Any,
    std: Any,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    padding: int | None = None,
    flip: float = 0.5,
) -> DeviceAugmentation:
    """``train_transform``'s augmentation, run on the device inside the train step.

    Pair it with ``decode_transform()`` on the host: the pipeline then ships uint8
    batches, and ``augmentation.wrap(loss_fn)`` crops (Inception-style with ``scale``
    and ``ratio``, or CIFAR-style with ``padding``), flips with probability ``flip``
    and normalises them in the jitted step. Use it for small images, where the host's
    per-image Python work is the bottleneck (docs/data.md, "Input at scale").

    Examples:
        >>> import jax, numpy as np
        >>> from meshkit.data.image import IMAGENET_MEAN, IMAGENET_STD
        >>> augment = device_augmentation(24, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        >>> images = np.zeros((4, 32, 32, 3), np.uint8)
        >>> out = jax.jit(augment)(images, jax.random.key(0))
        >>> out.shape, out.dtype
        ((4, 24, 24, 3), dtype('float32'))
    """
    fields = _augmentation(
        size, mean=mean, std=std, scale=scale, ratio=ratio, padding=padding, flip=flip
    )
    if min(fields["std"]) <= 0:
        raise ValueError(f"std must be positive, got {std!r}.")
    return DeviceAugmentation(**fields)
