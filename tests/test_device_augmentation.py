"""Augmentation on the device: the crops follow the host's rule, the flips and padded
crops are exact, the draws do not depend on the sharding, and the host side only decodes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit import data
from meshkit.data import image
from meshkit.data.image._device import _AUGMENT_STREAM

pytestmark = pytest.mark.once  # sharded and unsharded runs are compared in one test

UNIT: dict[str, Any] = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}  # output = pixels / 255


def ramp(height: int, width: int, batch: int) -> np.ndarray:
    """Images whose channel 0 is the row index, channel 1 the column index."""
    rows, cols = np.mgrid[0:height, 0:width]
    one = np.stack([rows, cols, np.full_like(rows, 7)], axis=-1).astype(np.uint8)
    return np.broadcast_to(one, (batch, height, width, 3)).copy()


@functools.cache
def augmented(size: int, **options) -> tuple[np.ndarray, np.ndarray]:
    """A batch of 64 ramps of 96×80 augmented with ``options``, as host numpy (×255)."""
    images = ramp(96, 80, 64)
    augment = image.device_augmentation(size, **UNIT, **options)
    out = jax.jit(augment)(images, jax.random.key(3))
    return images, np.asarray(out) * 255


def test_crops_follow_the_host_rule_on_a_ramp():
    size, scale, ratio = 16, (0.3, 1.0), (3 / 4, 4 / 3)
    _, out = augmented(size, scale=scale, ratio=ratio, flip=0.0)
    boxes = set()
    for example in out:
        # A linear resize of a linear ramp stays linear: output row i samples source row
        # top + (i + 0.5) * h / size - 0.5 (the ends are bent by the antialiasing).
        i = np.arange(3, size - 3)
        slope_r, offset_r = np.polyfit(i, example[3:-3, size // 2, 0], 1)
        slope_c, offset_c = np.polyfit(i, example[size // 2, 3:-3, 1], 1)
        h, w = slope_r * size, slope_c * size
        top, left = offset_r - 0.5 * slope_r + 0.5, offset_c - 0.5 * slope_c + 0.5
        assert 0 < h <= 96.5 and 0 < w <= 80.5, (h, w)
        assert top >= -0.5 and top + h <= 96.5 and left >= -0.5 and left + w <= 80.5
        assert scale[0] * 0.95 <= h * w / (96 * 80) <= scale[1] * 1.05
        assert ratio[0] * 0.95 <= w / h <= ratio[1] * 1.05
        np.testing.assert_allclose(example[..., 2], 7, atol=1e-3)
        boxes.add((round(h), round(w), round(top), round(left)))
    assert len(boxes) > 50  # every example draws its own box


def test_flips_mirror_the_same_crops_and_happen_at_the_rate_asked():
    _, kept = augmented(16, scale=(0.3, 1.0), flip=0.0)
    _, mirrored = augmented(16, scale=(0.3, 1.0), flip=1.0)
    np.testing.assert_allclose(mirrored, kept[:, :, ::-1], atol=1e-4)
    images = ramp(8, 8, 512)
    augment = image.device_augmentation(8, **UNIT, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    out = np.asarray(jax.jit(augment)(images, jax.random.key(0))) * 255
    flipped = np.isclose(out[:, 0, 0, 1], 7.0, atol=1e-3)  # column 7 now first
    assert np.all(flipped | np.isclose(out[:, 0, 0, 1], 0.0, atol=1e-3))
    assert 0.42 < flipped.mean() < 0.58


def test_padded_crops_are_windows_of_the_padded_image_normalised_as_on_the_host():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    mean, std = image.CIFAR10_MEAN, image.CIFAR10_STD
    augment = image.device_augmentation(32, mean=mean, std=std, padding=4, flip=0.0)
    out = np.asarray(jax.jit(augment)(images, jax.random.key(1)))
    padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
    offsets = set()
    for example, source in zip(out, padded, strict=True):
        matches = [
            (top, left)
            for top in range(9)
            for left in range(9)
            if np.allclose(
                example,
                image.normalize(source[top : top + 32, left : left + 32], mean, std),
                atol=1e-5,
            )
        ]
        assert len(matches) >= 1
        offsets.add(matches[0])
    assert len(offsets) > 8


def test_the_draws_do_not_depend_on_the_sharding():
    mesh = meshkit.make_mesh("data=-1")
    images = ramp(40, 40, 16)
    augment = jax.jit(
        image.device_augmentation(24, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)
    )
    key = jax.random.key(5)
    sharded = augment(meshkit.shard_batch(images, meshkit.batch_sharding(mesh)), key)
    single = augment(jax.device_put(images, jax.devices()[0]), key)
    assert len(sharded.sharding.device_set) == jax.device_count()
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), atol=1e-5)


def test_the_host_decodes_whole_uint8_batches_and_the_step_augments_them(tmp_path):
    records = data.write_digits_images(tmp_path / "digits", size=32)
    source = data.image_records(records["train"])
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(
        source, global_batch_size=16, sharding=sharding, transform=image.decode_transform()
    )
    batch = pipeline.local_batch(0)
    assert batch["image"].dtype == np.uint8 and batch["image"].shape == (16, 32, 32, 3)
    order = pipeline.epoch_order(0)[:16]
    expected = np.stack([image.decode(bytes(source[int(i)]["image"])) for i in order])
    np.testing.assert_array_equal(batch["image"], expected)

    augment = image.device_augmentation(24, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)

    def loss_fn(params, state, batch, rng):  # returns what it was given
        return jnp.mean(batch["image"]), batch["image"]

    images = meshkit.shard_batch(batch["image"], sharding)
    rng = jax.random.key(9)
    _, seen = jax.jit(augment.wrap(loss_fn))(None, None, {"image": images}, rng)
    expected = augment(images, jax.random.fold_in(rng, _AUGMENT_STREAM))
    assert seen.shape == (16, 24, 24, 3)
    np.testing.assert_allclose(np.asarray(seen), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"std": (0.0, 1.0, 1.0)}, "std must be positive"),
        ({"padding": -1}, "padding must be None or an int >= 0"),
        ({"flip": 2.0}, "flip must be a probability"),
        ({"scale": (0.9, 0.1)}, "scale"),
    ],
)
def test_device_augmentation_checks_its_arguments(kwargs, message):
    options = {"mean": image.IMAGENET_MEAN, "std": image.IMAGENET_STD} | kwargs
    with pytest.raises(ValueError, match=message):
        image.device_augmentation(24, **options)


def test_a_batch_of_the_wrong_rank_says_to_decode_on_the_host():
    augment = image.device_augmentation(8, **UNIT)
    with pytest.raises(ValueError, match="decode_transform"):
        augment(jnp.zeros((8, 8, 3), jnp.uint8), jax.random.key(0))
