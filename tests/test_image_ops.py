"""meshkit.data.image: geometry against numpy, determinism, codecs, errors, pickling."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from meshkit.data import image

pytestmark = pytest.mark.once  # numpy and Pillow only: no devices involved


def gradient(height: int, width: int) -> np.ndarray:
    """Channel 0 holds the row index, channel 1 the column index, channel 2 a constant."""
    rows, cols = np.mgrid[0:height, 0:width]
    return np.stack([rows, cols, np.full_like(rows, 7)], axis=-1).astype(np.uint8)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth image with mild noise: what JPEG is made for."""
    rows, cols = np.mgrid[0:height, 0:width]
    smooth = np.stack(
        [rows * 200 // height, cols * 200 // width, (rows + cols) * 100 // (height + width)], -1
    )
    noise = np.random.default_rng(seed).integers(0, 8, (height, width, 3))
    return (smooth + noise).astype(np.uint8)


def test_random_resized_crop_is_deterministic_per_seed():
    pixels = photo(48, 40)
    first = image.random_resized_crop(pixels, 24, np.random.default_rng(1))
    again = image.random_resized_crop(pixels, 24, np.random.default_rng(1))
    other = image.random_resized_crop(pixels, 24, np.random.default_rng(2))
    assert first.shape == (24, 24, 3) and first.dtype == np.uint8
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_crop_boxes_obey_scale_and_ratio_and_fit():
    height, width, scale, ratio = 120, 90, (0.2, 0.9), (0.6, 1.5)
    areas, aspects = [], []
    for seed in range(300):
        top, left, h, w = image.random_crop_box(
            height, width, np.random.default_rng(seed), scale=scale, ratio=ratio
        )
        assert 0 <= top <= height - h and 0 <= left <= width - w
        areas.append(h * w / (height * width))
        aspects.append(w / h)
    # Rounding the sides to pixels moves area and aspect slightly off their draws.
    assert scale[0] * 0.95 <= min(areas) and max(areas) <= scale[1] * 1.05
    assert ratio[0] * 0.97 <= min(aspects) and max(aspects) <= ratio[1] * 1.03
    assert len(set(areas)) > 100  # the draws vary


def test_crop_box_is_recoverable_from_a_gradient_image():
    """The crop's corners on a (row, column) ramp name the box the same seed draws."""
    pixels = gradient(200, 160)
    for seed in range(20):
        box = image.random_crop_box(200, 160, np.random.default_rng(seed), scale=(0.3, 1.0))
        top, left, h, w = box
        out = image.random_resized_crop(
            pixels, (h, w), np.random.default_rng(seed), scale=(0.3, 1.0)
        )
        # Output size = box size: a pure slice, exact.
        np.testing.assert_array_equal(out, pixels[top : top + h, left : left + w])
        small = image.random_resized_crop(
            pixels, (40, 32), np.random.default_rng(seed), scale=(0.3, 1.0)
        ).astype(float)
        # A bilinear resize of a linear ramp stays linear: pixel centres map back to
        # top + (i + 0.5) * h / 40 - 0.5 in the source (up to the ramp's ends).
        rows = top + (np.arange(40) + 0.5) * h / 40 - 0.5
        cols = left + (np.arange(32) + 0.5) * w / 32 - 0.5
        np.testing.assert_allclose(small[5:-5, 16, 0], rows[5:-5], atol=1.01)
        np.testing.assert_allclose(small[20, 5:-5, 1], cols[5:-5], atol=1.01)
        assert np.all(small[..., 2] == 7)


def test_crop_falls_back_to_the_largest_centred_box_in_ratio():
    # A 10×100 strip has no box with aspect <= 4/3 and area >= 50% of the strip.
    box = image.random_crop_box(10, 100, np.random.default_rng(0), scale=(0.5, 1.0))
    assert box == (0, (100 - 13) // 2, 10, 13)  # width = round(10 * 4/3)


def test_decode_and_random_crop_draws_the_same_box():
    pixels = photo(96, 128)
    data = image.encode(pixels, format="png")
    fused = image.decode_and_random_crop(data, 32, np.random.default_rng(3))
    plain = image.random_resized_crop(image.decode(data), 32, np.random.default_rng(3))
    np.testing.assert_array_equal(fused, plain)  # PNG: no reduced-scale decode


def test_decode_and_random_crop_with_reduced_scale_jpeg_stays_close():
    pixels = photo(512, 640)
    data = image.encode(pixels, quality=95)
    for seed in range(4):
        fused = image.decode_and_random_crop(data, 48, np.random.default_rng(seed))
        plain = image.random_resized_crop(image.decode(data), 48, np.random.default_rng(seed))
        assert fused.shape == plain.shape == (48, 48, 3)
        assert np.abs(fused.astype(int) - plain.astype(int)).mean() < 6


def test_flip_equals_numpy_reversal_and_draws_once():
    pixels = photo(8, 10)
    np.testing.assert_array_equal(
        image.horizontal_flip(pixels, np.random.default_rng(0), p=1.0), pixels[:, ::-1]
    )
    np.testing.assert_array_equal(
        image.horizontal_flip(pixels, np.random.default_rng(0), p=0.0), pixels
    )
    flips = [
        np.array_equal(image.horizontal_flip(pixels, np.random.default_rng(s)), pixels[:, ::-1])
        for s in range(200)
    ]
    assert 60 < sum(flips) < 140
    rng = np.random.default_rng(5)
    image.horizontal_flip(pixels, rng, p=0.0)
    assert rng.random() == np.random.default_rng(5).random(2)[1]


def test_center_crop_on_an_exact_size_image_is_numpy_slicing():
    pixels = photo(256, 256)
    np.testing.assert_array_equal(image.center_crop(pixels, 224), pixels[16:240, 16:240])
    np.testing.assert_array_equal(image.center_crop(pixels, 256, crop_fraction=1.0), pixels)
    wide = photo(64, 96)
    np.testing.assert_array_equal(
        image.center_crop(wide, 32, crop_fraction=0.5), wide[16:48, 32:64]
    )


def test_center_crop_resizes_the_central_region():
    pixels = gradient(100, 200)
    out = image.center_crop(pixels, 50, crop_fraction=0.8).astype(float)
    assert out.shape == (50, 50, 3)
    # The shorter side 100 maps to 50 / 0.8 = 62.5: the crop covers 80 source pixels.
    rows = 10 + (np.arange(50) + 0.5) * 80 / 50 - 0.5
    cols = 60 + (np.arange(50) + 0.5) * 80 / 50 - 0.5
    np.testing.assert_allclose(out[3:-3, 25, 0], rows[3:-3], atol=1.01)
    np.testing.assert_allclose(out[25, 3:-3, 1], cols[3:-3], atol=1.01)


def test_resize_shape_and_constant_image():
    out = image.resize(np.full((30, 40, 3), 9, np.uint8), (15, 12), resample="bicubic")
    assert out.shape == (15, 12, 3) and out.dtype == np.uint8
    assert np.all(out == 9)
    gray = image.resize(np.full((30, 40), 3, np.uint8), 10)
    assert gray.shape == (10, 10, 1)


def test_normalize_matches_numpy():
    pixels = photo(5, 6)
    out = image.normalize(pixels, image.IMAGENET_MEAN, image.IMAGENET_STD)
    expected = (pixels / 255.0 - np.array(image.IMAGENET_MEAN)) / np.array(image.IMAGENET_STD)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    floats = image.normalize(pixels / 255.0, 0.5, 0.25)
    np.testing.assert_allclose(floats, (pixels / 255.0 - 0.5) / 0.25, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mean has 2 values but the image has 3 channels"):
        image.normalize(pixels, (0.5, 0.5), (1.0, 1.0, 1.0))


def test_png_round_trip_is_exact():
    for pixels in (photo(17, 23), photo(9, 9)[:, :, :1]):
        data = image.encode(pixels, format="png")
        np.testing.assert_array_equal(image.decode(data, channels=None), pixels)
    rgba = np.concatenate([photo(6, 7), np.full((6, 7, 1), 200, np.uint8)], axis=-1)
    np.testing.assert_array_equal(image.decode(image.encode(rgba, format="png")), rgba[..., :3])


def test_jpeg_round_trip_within_tolerance():
    pixels = photo(64, 48)
    decoded = image.decode(image.encode(pixels, quality=95))
    assert decoded.shape == pixels.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - pixels.astype(int)).mean() < 4


def test_decode_converts_channels():
    gray = photo(12, 12)[:, :, 0]
    data = image.encode(gray, format="png")
    rgb = image.decode(data)
    assert rgb.shape == (12, 12, 3)
    np.testing.assert_array_equal(rgb, np.repeat(gray[:, :, None], 3, axis=-1))
    assert image.decode(data, channels=1).shape == (12, 12, 1)
    assert image.decode(np.frombuffer(data, np.uint8), channels=None).shape == (12, 12, 1)
    assert image.decode(np.bytes_(data)).shape == (12, 12, 3)


@pytest.mark.parametrize(
    "data",
    [b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, b""],
    ids=["text", "png-header-only", "empty"],
)
def test_corrupt_bytes_raise_value_error_naming_the_expected_format(data):
    with pytest.raises(ValueError, match="expected a complete JPEG or PNG file"):
        image.decode(data)


def test_truncated_jpeg_raises_value_error():
    data = image.encode(photo(64, 64))
    with pytest.raises(ValueError, match="expected a complete JPEG or PNG file"):
        image.decode(data[: len(data) // 2])


def test_unsupported_format_raises_value_error():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(photo(8, 8)).save(buffer, format="BMP")
    with pytest.raises(ValueError, match=r"starting b'BM"):
        image.decode(buffer.getvalue())


def test_decoded_arrays_are_not_taken_as_bytes():
    with pytest.raises(ValueError, match="Expected encoded image bytes"):
        image.decode(np.zeros((4, 4), np.float32))


def test_train_transform_on_bytes_and_arrays():
    transform = image.train_transform(16, mean=image.CIFAR10_MEAN, std=image.CIFAR10_STD)
    pixels = photo(40, 30)
    for value in (image.encode(pixels), pixels):
        record = {"image": value, "label": np.int64(4), "id": np.int64(9)}
        first = transform(record, np.random.default_rng(7))
        again = transform(record, np.random.default_rng(7))
        other = transform(record, np.random.default_rng(8))
        assert first["image"].shape == (16, 16, 3) and first["image"].dtype == np.float32
        assert first["label"].dtype == np.int32 and int(first["label"]) == 4
        assert int(first["id"]) == 9
        np.testing.assert_array_equal(first["image"], again["image"])
        assert not np.array_equal(first["image"], other["image"])


def test_train_transform_with_padding_is_the_cifar_augmentation():
    pixels = photo(32, 32)
    transform = image.train_transform(32, mean=0.0, std=1.0, padding=4, flip=0.0)
    out = transform({"image": pixels, "label": np.int64(0)}, np.random.default_rng(3))
    rng = np.random.default_rng(3)
    top, left = rng.integers(0, 9), rng.integers(0, 9)
    padded = np.pad(pixels, ((4, 4), (4, 4), (0, 0)))
    expected = padded[top : top + 32, left : left + 32] / 255.0
    np.testing.assert_allclose(out["image"], expected, atol=1e-6)


def test_eval_transform_crops_the_centre():
    pixels = photo(36, 36)
    transform = image.eval_transform(32, mean=0.0, std=1.0, crop_fraction=32 / 36)
    for value in (pixels, image.encode(pixels, format="png")):
        out = transform({"image": value, "label": np.int64(2)})
        np.testing.assert_allclose(out["image"], pixels[2:34, 2:34] / 255.0, atol=1e-6)
        assert out["label"].dtype == np.int32


def test_transforms_pickle_round_trip():
    train = image.train_transform((24, 20), mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)
    evaluation = image.eval_transform(24, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)
    record = {"image": image.encode(photo(50, 40)), "label": np.int64(1)}
    for transform in (train, evaluation):
        restored = pickle.loads(pickle.dumps(transform))
        assert restored == transform
    np.testing.assert_array_equal(
        pickle.loads(pickle.dumps(train))(record, np.random.default_rng(0))["image"],
        train(record, np.random.default_rng(0))["image"],
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "size must be a positive int"),
        ({"size": (3, 4, 5)}, "size must be a positive int"),
        ({"scale": (0.5, 0.1)}, "scale must satisfy"),
        ({"ratio": (0, 1)}, "ratio must satisfy"),
        ({"flip": 2.0}, "flip must be a probability"),
        ({"mean": (0.5, 0.5)}, "mean has 2 values"),
        ({"resample": "nearest"}, "resample must be one of"),
    ],
)
def test_train_transform_checks_its_arguments(kwargs, message):
    arguments = {"size": 8, "mean": image.IMAGENET_MEAN, "std": image.IMAGENET_STD, **kwargs}
    with pytest.raises(ValueError, match=message):
        image.train_transform(**arguments)


def test_transforms_work_in_a_train_pipeline():
    import meshkit
    from meshkit import data

    pixels = np.stack([photo(20, 20, seed) for seed in range(16)])
    source = data.ArraySource({"image": pixels, "label": np.arange(16) % 3})
    mesh = meshkit.make_mesh("data=1", devices=__import__("jax").devices()[:1])
    transform = image.train_transform(8, mean=image.CIFAR10_MEAN, std=image.CIFAR10_STD)
    pipeline = data.TrainPipeline(
        source, global_batch_size=8, sharding=meshkit.batch_sharding(mesh), transform=transform
    )
    batch = pipeline.local_batch(0)
    assert batch["image"].shape == (8, 8, 8, 3) and batch["image"].dtype == np.float32
    assert batch["label"].dtype == np.int32
    assert math.isfinite(float(batch["image"].sum()))


@pytest.mark.parametrize("padding", [None, 4], ids=["inception-crop", "cifar-crop"])
@pytest.mark.parametrize("encoded", [True, False], ids=["jpeg", "array"])
def test_the_batched_transform_equals_the_per_example_one_pixel_for_pixel(padding, encoded):
    """Crops per example with the same draws; flips over the batch, then normalisation
    (``finish``)."""
    transform = image.train_transform(
        16, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD, padding=padding, scale=(0.3, 1.0)
    )
    records = []
    for seed in range(24):
        pixels = photo(16 + seed % 3 * 8, 20, seed) if padding is None else photo(16, 16, seed)
        value = image.encode(pixels, format="jpeg") if encoded else pixels
        records.append({"image": value, "label": np.int64(seed % 5), "id": np.int64(seed)})

    def generators():
        return [np.random.default_rng([7, index]) for index in range(len(records))]

    batch = transform.batch(records, generators())
    assert batch["image"].dtype == np.uint8  # what worker processes send
    batch = transform.finish(batch)
    one_by_one = [transform(record, rng) for record, rng in zip(records, generators(), strict=True)]
    assert sorted(batch) == ["id", "image", "label"]
    for key in batch:
        expected = np.stack([example[key] for example in one_by_one])
        assert batch[key].dtype == expected.dtype
        np.testing.assert_array_equal(batch[key], expected)


def test_input_settings_follow_cores_and_image_size():
    def threads_and_workers(side, cores=None):
        settings = image.input_settings(side, cores=cores)
        return settings.num_threads, settings.worker_count

    assert threads_and_workers(32, cores=1) == (0, 0)
    assert threads_and_workers(64, cores=4) == (0, 4)
    assert threads_and_workers(224, cores=4) == (4, 0)
    assert image.input_settings(32).resident is False
    with pytest.raises(ValueError, match="image_side must be a positive int"):
        image.input_settings(0)
