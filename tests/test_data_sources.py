"""Data sources: file readers on real on-disk formats, digits, synthetic, ArrayRecord, convert.

Every file is written here in its real format (IDX with big-endian headers, CIFAR
pickles with bytes keys) and read back; corrupt variants check the error messages.
"""

from __future__ import annotations

import builtins
import gzip
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import scipy.ndimage

from meshkit.data import (
    ArrayRecordSource,
    ArraySource,
    Source,
    cifar10,
    cifar100,
    digits,
    fashion_mnist,
    load_npz,
    mnist,
    synthetic,
    write_array_record,
)
from meshkit.data.convert import convert
from meshkit.testing import write_cifar10, write_cifar100, write_mnist
from meshkit.testing._files import cifar_batch, write_idx, write_pickle

pytestmark = pytest.mark.once  # file readers and sources: no devices involved

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers


def all_records(source: Source) -> dict[str, np.ndarray]:
    records = [source[i] for i in range(len(source))]
    return {key: np.stack([record[key] for record in records]) for key in records[0]}


def sidecar_path(path: Path) -> Path:
    """Where ArrayRecordSource documents the sidecar: the file's path with ``.json`` appended."""
    return path.with_name(path.name + ".json")


def chw_to_hwc_by_hand(data_Nx3072: np.ndarray) -> np.ndarray:
    """Independent reference: pixel (h, w, c) is byte c*1024 + h*32 + w of a record."""
    h, w, c = np.meshgrid(np.arange(32), np.arange(32), np.arange(3), indexing="ij")
    return data_Nx3072[:, c * 1024 + h * 32 + w]


# ------------------------------------------------------------------------------ MNIST


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dotted", [False, True])
def test_mnist_reads_idx_files(tmp_path, suffix, dotted):
    arrays = write_mnist(tmp_path, suffix=suffix, dotted=dotted)
    for split in ("train", "test"):
        source = mnist(tmp_path, split)
        images, labels = arrays[split]
        got = all_records(source)
        assert got["image"].dtype == np.uint8 and got["image"].shape == (len(images), 28, 28, 1)
        assert got["label"].dtype == np.int32
        np.testing.assert_array_equal(got["image"][..., 0], images)
        np.testing.assert_array_equal(got["label"], labels)
        assert isinstance(source, Source)


def test_fashion_mnist_reads_the_same_format(tmp_path):
    arrays = write_mnist(tmp_path, suffix=".gz")
    source = fashion_mnist(tmp_path, "test")
    np.testing.assert_array_equal(all_records(source)["image"][..., 0], arrays["test"][0])
    assert source.fingerprint != mnist(tmp_path, "test").fingerprint


def test_mnist_missing_files_name_the_files_the_folder_and_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        mnist(tmp_path, "test")
    message = str(info.value)
    assert message.startswith(
        f"MNIST test images and labels not found: {tmp_path} holds no t10k-images-idx3-ubyte "
        "and t10k-labels-idx1-ubyte (gzipped or not, or dotted: t10k-images.idx3-ubyte). "
    )
    assert "homepage" in message and "--data-dir" in message and "\n" not in message
    with pytest.raises(FileNotFoundError) as info:
        mnist(tmp_path / "absent", "test")
    assert str(info.value).startswith(
        f"MNIST test images and labels not found: {tmp_path / 'absent'} does not exist. "
    )


def test_mnist_only_labels_missing_names_labels(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(FileNotFoundError, match="MNIST train labels not found") as info:
        mnist(tmp_path, "train")
    assert "train-images" not in str(info.value).split("Download")[0]


def test_mnist_wrong_magic_names_file_found_and_expected(tmp_path):
    write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3, np.uint8), magic=2051)
    with pytest.raises(ValueError) as info:
        mnist(tmp_path, "test")
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "2051" in message and "expected 2049" in message


def test_mnist_gzip_without_suffix_gets_a_hint(tmp_path):
    write_mnist(tmp_path)
    data = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match=r"expected 2051.*\.gz suffix"):
        mnist(tmp_path, "train")


def test_mnist_truncated_body_names_expected_and_found_bytes(tmp_path):
    write_mnist(tmp_path, num_test=3)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[: 16 + 2 * 784 + 10])
    with pytest.raises(ValueError) as info:
        mnist(tmp_path, "test")
    message = str(info.value)
    assert str(path) in message and "truncated" in message
    assert f"3×28×28 = {3 * 784} bytes" in message and f"found {2 * 784 + 10}" in message


def test_mnist_truncated_header_and_trailing_bytes(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">i", 2049) + b"\x00")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte is truncated.*needs 8 bytes"):
        mnist(tmp_path, "test")
    path = write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5, np.uint8))
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(ValueError, match=r"trailing bytes.*5 = 5 bytes of data, found 6"):
        mnist(tmp_path, "train")


def test_mnist_truncated_gzip_names_file(tmp_path):
    write_mnist(tmp_path, suffix=".gz")
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"Cannot decompress .*train-images-idx3-ubyte\.gz"):
        mnist(tmp_path, "train")


def test_mnist_count_mismatch_names_both_counts(tmp_path):
    write_mnist(tmp_path, num_train=4)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match=r"holds 4 images but .* holds 3 labels"):
        mnist(tmp_path, "train")


def test_mnist_label_out_of_range(tmp_path):
    write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([1, 12, 3], np.uint8))
    with pytest.raises(ValueError) as info:
        mnist(tmp_path, "test")
    message = str(info.value)
    assert str(tmp_path / "t10k-labels-idx1-ubyte") in message
    assert "label 12 at index 1 is outside the classes [0, 10)" in message


def test_bad_split_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="'validation'"):
        mnist(tmp_path, "validation")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ CIFAR


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-py"])
def test_cifar10_reads_pickles_as_hwc(tmp_path, subdir):
    batches = write_cifar10(tmp_path / subdir)
    for split in ("train", "test"):
        got = all_records(cifar10(tmp_path, split))
        data = np.concatenate([np.asarray(b[b"data"]) for b in batches[split]])
        labels = np.concatenate([b[b"labels"] for b in batches[split]])  # type: ignore[arg-type]
        assert got["image"].dtype == np.uint8 and got["image"].shape == (len(data), 32, 32, 3)
        assert got["label"].dtype == np.int32
        np.testing.assert_array_equal(got["image"], chw_to_hwc_by_hand(data))
        np.testing.assert_array_equal(got["label"], labels)
    assert len(cifar10(tmp_path, "train")) == 5 * 2


@pytest.mark.parametrize("label", ["fine", "coarse"])
def test_cifar100_fine_and_coarse_labels(tmp_path, label):
    batches = write_cifar100(tmp_path / "cifar-100-python")
    got = all_records(cifar100(tmp_path, "train", label=label))
    np.testing.assert_array_equal(got["label"], batches["train"][f"{label}_labels".encode()])
    np.testing.assert_array_equal(
        got["image"], chw_to_hwc_by_hand(np.asarray(batches["train"][b"data"]))
    )
    fine = cifar100(tmp_path, "train", label="fine").fingerprint
    assert (fine == cifar100(tmp_path, "train", label=label).fingerprint) == (label == "fine")


def test_cifar_missing_files_name_the_files_and_both_folders(tmp_path):
    write_pickle(tmp_path / "data_batch_1", cifar_batch(1, np.random.default_rng(0), labels=[0]))
    with pytest.raises(FileNotFoundError) as info:
        cifar10(tmp_path, "train")
    names = ", ".join(f"data_batch_{i}" for i in range(1, 6))
    assert str(info.value).startswith(
        f"CIFAR-10 {names} not found: {tmp_path} holds no such files, "
        "nor does its cifar-10-batches-py/ folder."
    )
    assert "cifar-10-python.tar.gz" in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"cifar-100-python\.tar\.gz") as info:
        cifar100(tmp_path, "test")
    assert "CIFAR-100 test not found" in str(info.value)


def test_cifar_not_a_pickle_names_file(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "test_batch").write_bytes(b"this is not a pickle at all")
    with pytest.raises(ValueError, match=r"test_batch is not a readable CIFAR pickle"):
        cifar10(tmp_path, "test")


def test_cifar_missing_keys_names_expected_and_found(tmp_path):
    write_cifar10(tmp_path)
    write_pickle(tmp_path / "test_batch", {b"data": np.zeros((1, 3072), np.uint8)})
    with pytest.raises(ValueError) as info:
        cifar10(tmp_path, "test")
    assert "test_batch" in str(info.value) and "b'labels'" in str(info.value)
    write_pickle(tmp_path / "test_batch", [1, 2, 3])
    with pytest.raises(ValueError, match=r"expected a dict .* found list"):
        cifar10(tmp_path, "test")


def test_cifar_wrong_record_size(tmp_path):
    write_cifar10(tmp_path)
    write_pickle(
        tmp_path / "test_batch", {b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}
    )
    with pytest.raises(ValueError) as info:
        cifar10(tmp_path, "test")
    message = str(info.value)
    assert "test_batch" in message and "(2, 3000)" in message and "3072" in message


def test_cifar_label_count_mismatch(tmp_path):
    write_cifar10(tmp_path)
    batch = {b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1]}
    write_pickle(tmp_path / "data_batch_4", batch)
    with pytest.raises(ValueError, match=r"data_batch_4 holds 3 images but 2 labels"):
        cifar10(tmp_path, "train")


# ----------------------------------------------------------------------------- digits


@pytest.mark.parametrize("image_size", [8, 28, 32])
@pytest.mark.parametrize("channels", [1, 3])
def test_digits_shapes_dtypes_ranges(image_size, channels):
    splits: list[tuple[Literal["train", "test"], int]] = [("train", 1437), ("test", 360)]
    for split, size in splits:
        source = digits(split, image_size=image_size, channels=channels)
        images, labels = source.arrays["image"], source.arrays["label"]
        assert len(source) == size
        assert images.shape == (size, image_size, image_size, channels)
        assert images.dtype == np.float32 and labels.dtype == np.int32
        assert images.min() >= 0.0 and images.max() <= 1.0 and images.max() > 0.9
        assert set(np.unique(labels).tolist()) == set(range(10))
        if channels == 3:
            np.testing.assert_array_equal(images[..., 1], images[..., 0])
            np.testing.assert_array_equal(images[..., 2], images[..., 0])


def test_digits_split_is_the_documented_permutation_and_disjoint():
    from sklearn.datasets import load_digits

    data, target = load_digits(return_X_y=True)
    images = np.asarray(data).reshape(-1, 8, 8)
    order = np.random.default_rng(0).permutation(1797)
    train, test = digits("train"), digits("test")
    np.testing.assert_allclose(train.arrays["image"][..., 0], images[order[:1437]] / 16)
    np.testing.assert_allclose(test.arrays["image"][..., 0], images[order[1437:]] / 16)
    np.testing.assert_array_equal(test.arrays["label"], np.asarray(target)[order[1437:]])
    train_images = {image.tobytes() for image in train.arrays["image"]}
    test_images = {image.tobytes() for image in test.arrays["image"]}
    assert len(train_images) == 1437 and len(test_images) == 360
    assert not train_images & test_images


def test_digits_fingerprints_differ_by_split_size_channels_and_are_stable():
    combos = [(s, z, c) for s in ("train", "test") for z in (8, 28, 32) for c in (1, 3)]
    prints = {digits(s, image_size=z, channels=c).fingerprint for s, z, c in combos}  # type: ignore[arg-type]
    assert len(prints) == len(combos)
    assert digits("test").fingerprint == digits("test").fingerprint


def test_digits_are_loaded_once(monkeypatch):
    """The docstring's promise: loaded arrays are cached, later calls do not read again."""
    first = digits("train").arrays["image"].copy()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # a reload would fail now
    assert len(digits("test", image_size=28)) == 360
    again = digits("train").arrays["image"]
    np.testing.assert_array_equal(again, first)
    again[...] = 0  # a caller's writes do not reach the cache
    np.testing.assert_array_equal(digits("train").arrays["image"], first)


@pytest.mark.parametrize("image_size", [28, 32])
def test_digits_resize_matches_scipy_zoom(image_size):
    gray = digits("test").arrays["image"][..., 0].astype(np.float64)
    got = digits("test", image_size=image_size).arrays["image"][..., 0]
    zoom = image_size / 8
    for index in (0, 1, 359):
        reference = scipy.ndimage.zoom(gray[index], zoom, order=1, grid_mode=True, mode="nearest")
        np.testing.assert_allclose(got[index], np.asarray(reference), atol=1e-6)


@pytest.mark.parametrize("image_size", [28, 32])
def test_digits_resize_keeps_the_mean_brightness_of_the_interior(image_size):
    """Bilinear weights sum to one: an enlarged image's mean stays near the original's."""
    small = digits("test").arrays["image"][..., 0]
    large = digits("test", image_size=image_size).arrays["image"][..., 0]
    np.testing.assert_allclose(large.mean(axis=(1, 2)), small.mean(axis=(1, 2)), atol=0.02)


def test_digits_without_sklearn_says_what_to_install():
    """In a fresh process (nothing cached) where scikit-learn cannot be imported."""
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "from meshkit.data import digits\n"
        "try:\n    digits('train')\nexcept ImportError as error:\n    print(error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert "pip install scikit-learn" in out.stdout and "meshkit[recipes]" in out.stdout


def test_synthetic_is_deterministic_with_small_dtypes():
    a, b = synthetic(16, (8, 8, 3), seed=3), synthetic(16, (8, 8, 3), seed=3)
    np.testing.assert_array_equal(a.arrays["image"], b.arrays["image"])
    np.testing.assert_array_equal(a.arrays["label"], b.arrays["label"])
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != synthetic(16, (8, 8, 3), seed=4).fingerprint
    assert a.arrays["image"].dtype == np.uint8 and a.arrays["image"].shape == (16, 8, 8, 3)
    labels = synthetic(200, (2,), num_classes=3).arrays["label"]
    assert labels.dtype == np.int32 and set(labels.tolist()) == {0, 1, 2}
    floats = synthetic(8, (4,), dtype=np.float32).arrays["image"]
    assert floats.dtype == np.float32 and floats.min() >= 0 and floats.max() < 1


# ------------------------------------------------------------------------ ArrayRecord


def assert_same_records(a: Source, b: Source) -> None:
    assert len(a) == len(b)
    expected, got = all_records(a), all_records(b)
    assert expected.keys() == got.keys()
    for key in expected:
        assert got[key].dtype == expected[key].dtype
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize(
    "make",
    [
        lambda: digits("test", image_size=28),
        lambda: synthetic(50, (6, 5, 3), seed=1),
        lambda: ArraySource(
            {
                "x": np.arange(24, dtype=">i4").reshape(4, 3, 2),
                "flag": np.array([True, False, True, True]),
                "w": np.linspace(0, 1, 4),
            }
        ),
    ],
    ids=["digits", "synthetic", "mixed_dtypes"],
)
def test_array_record_round_trip(tmp_path, make):
    source = make()
    path = write_array_record(source, tmp_path / "nested" / "data.array_record")
    assert path.is_file() and sidecar_path(path).is_file()
    assert not list(path.parent.glob("*.partial"))
    read = ArrayRecordSource(path)
    assert isinstance(read, Source)
    assert_same_records(source, read)
    indices = np.array([3, 0, 3, len(source) - 1])
    batch = read.getitems(indices)
    examples = read.examples(indices)  # a batch's records for a per-example transform
    for key, value in source.getitems(indices).items():  # type: ignore[attr-defined]
        np.testing.assert_array_equal(batch[key], value)
        assert batch[key].dtype == value.dtype
        np.testing.assert_array_equal(np.stack([example[key] for example in examples]), value)
    np.testing.assert_array_equal(
        read[-1][next(iter(batch))], read[len(read) - 1][next(iter(batch))]
    )
    assert ArrayRecordSource(path).fingerprint == read.fingerprint
    restored = pickle.loads(pickle.dumps(read))
    assert_same_records(read, restored)


def test_array_record_sidecar_holds_fields_and_count(tmp_path):
    path = write_array_record(synthetic(5, (2, 3)), tmp_path / "s.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    assert spec["count"] == 5
    assert spec["fields"] == [
        {"name": "image", "dtype": "|u1", "shape": [2, 3]},
        {"name": "label", "dtype": "<i4", "shape": []},
    ]
    other = write_array_record(synthetic(5, (2, 3), seed=1), tmp_path / "t.array_record")
    assert ArrayRecordSource(path).fingerprint != ArrayRecordSource(other).fingerprint


def test_array_record_missing_file_or_sidecar(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No ArrayRecord file at .*absent\.array_record"):
        ArrayRecordSource(tmp_path / "absent.array_record")
    path = write_array_record(synthetic(3, (2,)), tmp_path / "s.array_record")
    sidecar_path(path).unlink()
    with pytest.raises(FileNotFoundError, match=r"No sidecar at .*s\.array_record\.json"):
        ArrayRecordSource(path)


def test_array_record_size_mismatch_names_record_and_bytes(tmp_path):
    path = write_array_record(synthetic(4, (4, 4, 3)), tmp_path / "s.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    spec["fields"][0]["shape"] = [4, 4, 4]
    sidecar_path(path).write_text(json.dumps(spec))
    source = ArrayRecordSource(path)
    with pytest.raises(ValueError, match=r"Record 2 of .* has 52 bytes; .* describes 68 bytes"):
        source[2]
    with pytest.raises(ValueError, match=r"Record 1 .* has 52 bytes"):
        source.getitems([1, 2])


def test_array_record_count_and_format_mismatch(tmp_path):
    path = write_array_record(synthetic(4, (2,)), tmp_path / "s.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**spec, "count": 9}))
    with pytest.raises(ValueError, match=r"holds 4 records but .* says 9"):
        ArrayRecordSource(path)
    sidecar_path(path).write_text("{not json")
    with pytest.raises(ValueError, match=r"s\.array_record\.json is not a valid sidecar"):
        ArrayRecordSource(path)


def test_array_record_rejects_inconsistent_examples_and_bad_indices(tmp_path):
    class Ragged:
        fingerprint = "ragged"

        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> dict[str, np.ndarray]:
            return {"x": np.zeros(2 + (index == 2), np.float32)}

    with pytest.raises(ValueError, match=r"Example 2 has 'x' of <f4\[3\]; example 0 had <f4\[2\]"):
        write_array_record(Ragged(), tmp_path / "r.array_record")
    assert not list(tmp_path.iterdir())
    source = ArrayRecordSource(write_array_record(synthetic(3, (2,)), tmp_path / "s.array_record"))
    with pytest.raises(IndexError, match="Index 3 is out of range for 3 records"):
        source[3]


def random_bytes_source(n: int = 6) -> ArraySource:
    """Incompressible records: each one's bytes appear verbatim in the ArrayRecord file."""
    return ArraySource({"x": np.random.default_rng(0).integers(0, 256, (n, 32), dtype=np.uint8)})


def test_array_record_damaged_payload_names_the_file_and_record(tmp_path):
    source = random_bytes_source()
    path = write_array_record(source, tmp_path / "s.array_record")
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(source.arrays["x"][3].tobytes())
    assert offset > 0
    data[offset + 5] ^= 0xFF  # one flipped bit pattern inside record 3
    path.write_bytes(bytes(data))
    read = ArrayRecordSource(path)  # the header and the index are intact
    np.testing.assert_array_equal(read[2]["x"], source.arrays["x"][2])
    for damaged in (
        lambda: read[3],
        lambda: read.getitems([1, 3, 5]),
        lambda: read.examples([5, 3]),
    ):
        with pytest.raises(ValueError) as info:
            damaged()
        message = str(info.value)
        assert f"Record 3 of {path} cannot be read" in message, message
        assert "damaged or truncated" in message and "write_array_record" in message


def test_array_record_truncated_file_names_the_file_and_the_fix(tmp_path):
    path = write_array_record(random_bytes_source(), tmp_path / "s.array_record")
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError) as info:
        ArrayRecordSource(path)
    message = str(info.value)
    assert f"{path} is not a readable ArrayRecord file" in message, message
    assert "python -m meshkit.data.convert" in message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda spec: {**spec, "fields": [*spec["fields"], spec["fields"][0]]},
            r"names the field\(s\) \['image'\] more than once \(image: \|u1\[2\], label: "
            r"<i4\[\], image: \|u1\[2\]\)",
        ),
        (
            lambda spec: json.dumps(spec).replace('"count": 3', '"count": 3, "count": 4'),
            r"not a valid sidecar \(ValueError: the key\(s\) \['count'\] appear twice",
        ),
    ],
    ids=["field_name", "json_key"],
)
def test_array_record_duplicate_sidecar_entries_are_refused(tmp_path, edit, expected):
    path = write_array_record(synthetic(3, (2,)), tmp_path / "s.array_record")
    edited = edit(json.loads(sidecar_path(path).read_text()))
    sidecar_path(path).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ValueError, match=expected) as info:
        ArrayRecordSource(path)
    assert str(sidecar_path(path)) in str(info.value)
    assert "write_array_record" in str(info.value)


# -------------------------------------------------------------------------------- npz


def damage_npz(tmp_path: Path, how: str) -> Path:
    """An .npz file (or what claims to be one) damaged in one of the ways users meet."""
    path = tmp_path / "d.npz"
    arrays = {"image": np.arange(64.0).reshape(16, 4), "label": np.arange(16) % 3}
    if how == "npy":
        path = tmp_path / "d.npy"
        np.save(path, arrays["image"])
        return path
    (np.savez_compressed if how == "deflate" else np.savez)(path, **arrays)
    data = bytearray(path.read_bytes())
    if how == "empty":
        data = bytearray()
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "not_zip":
        data = bytearray(b"<html>404</html>")
    else:  # a stored (crc) or deflated member with bytes overwritten in its data
        data[150:170] = b"\x00" * 20
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("empty", "is not an .npz archive: it is empty"),
        ("not_zip", "is not an .npz archive: it starts with b'<html>"),
        ("truncated", "as an .npz archive (zipfile.BadZipFile: File is not a zip file)"),
        ("crc", "Cannot read array 'image' of"),
        ("deflate", "Cannot read array 'image' of"),
        ("npy", "is a .npy file (one unnamed array, written by np.save)"),
    ],
)
def test_load_npz_damaged_file_names_the_file_and_the_fix(tmp_path, how, expected):
    path = damage_npz(tmp_path, how)
    with pytest.raises(ValueError) as info:  # never BadZipFile, EOFError or TypeError
        load_npz(path)
    message = str(info.value)
    assert str(path) in message and expected in message, message
    assert "np.savez" in message


def test_load_npz_refuses_pickles_and_foreign_zips_naming_the_array(tmp_path):
    np.savez(tmp_path / "o.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match=r"array 'x' of .*o\.npz .* holds pickled Python objects"):
        load_npz(tmp_path / "o.npz")
    with zipfile.ZipFile(tmp_path / "z.npz", "w") as archive:
        archive.writestr("notes.txt", "not an array")
    with pytest.raises(ValueError, match=r"z\.npz holds 'notes\.txt', which is not a \.npy array"):
        load_npz(tmp_path / "z.npz")
    np.savez(tmp_path / "k.npz", image=np.zeros(2))
    with pytest.raises(ValueError, match=r"has no arrays \['label'\]; it holds \['image'\]"):
        load_npz(tmp_path / "k.npz", keys=("image", "label"))


# ---------------------------------------------------------------------------- convert


def test_convert_mnist_end_to_end(tmp_path):
    write_mnist(tmp_path / "raw", num_train=6, num_test=4, suffix=".gz")
    paths = convert("mnist", tmp_path / "raw", tmp_path / "out")
    assert paths == [
        tmp_path / "out" / "train.array_record",
        tmp_path / "out" / "test.array_record",
    ]
    for split, path in zip(("train", "test"), paths, strict=True):
        assert_same_records(mnist(tmp_path / "raw", split), ArrayRecordSource(path))


def test_convert_leaves_out_dir_untouched_when_a_file_is_missing(tmp_path):
    write_mnist(tmp_path / "raw")
    (tmp_path / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError):
        convert("mnist", tmp_path / "raw", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "meshkit.data.convert", *args]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )


def test_convert_cli_on_cifar10(tmp_path):
    write_cifar10(tmp_path / "raw" / "cifar-10-batches-py", per_batch=3)
    done = run_cli("cifar10", "--data-dir", str(tmp_path / "raw"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "train.array_record: 15 records" in done.stdout
    assert "test.array_record: 3 records" in done.stdout
    for split in ("train", "test"):
        converted = ArrayRecordSource(tmp_path / "out" / f"{split}.array_record")
        assert_same_records(cifar10(tmp_path / "raw", split), converted)
    missing = run_cli("mnist", "--data-dir", str(tmp_path / "raw"), "--out", str(tmp_path / "o2"))
    assert missing.returncode == 2
    assert "MNIST train images and labels not found" in missing.stderr
    assert "Traceback" not in missing.stderr


# ----------------------------------------------------------------------------- labels


def labelled(labels: list[int], dtype: type = np.int32) -> dict[str, np.ndarray]:
    n = len(labels)
    return {
        "image": np.arange(n * 4, dtype=np.float32).reshape(n, 2, 2),
        "label": np.array(labels, dtype),
    }


def assert_label_error(message: str, where: str, value: int, at: str) -> None:
    """The message names the source, the value and its index, and says how to fix it."""
    assert where in message and f"label {value} at {at}" in message, message
    assert "np.unique(labels, return_inverse=True)" in message and "ignore_label=" in message


@pytest.mark.parametrize(("value", "num_classes"), [(-1, 10), (-1, None), (10, 10), (12, 10)])
def test_array_source_rejects_labels_outside_the_classes(value, num_classes):
    with pytest.raises(ValueError) as info:
        ArraySource(labelled([3, 0, value, 9]), name="train", num_classes=num_classes)
    assert_label_error(str(info.value), "ArraySource 'train'", value, "index 2")
    if num_classes is not None:
        assert f"outside the classes [0, {num_classes})" in str(info.value)


def test_array_source_counts_the_other_bad_labels():
    with pytest.raises(ValueError, match=r"label -1 at index 1 .*; 2 more example\(s\)"):
        ArraySource(labelled([0, -1, 5, 10, 11]), num_classes=10)


def test_array_source_without_num_classes_admits_any_non_negative_label():
    source = ArraySource(labelled([0, 7, 1000]))
    assert source.num_classes is None
    np.testing.assert_array_equal(source.arrays["label"], [0, 7, 1000])


def test_array_source_keeps_valid_labels_unchanged():
    arrays = labelled([9, 0, 4], dtype=np.uint8)
    source = ArraySource(arrays, num_classes=10)
    assert source.num_classes == 10 and source.ignore_label is None
    for key, value in arrays.items():
        np.testing.assert_array_equal(source.arrays[key], value)
        assert source.arrays[key].dtype == value.dtype
    assert source.fingerprint == ArraySource(arrays).fingerprint  # num_classes is not data


@pytest.mark.parametrize("dtype", [np.float32, np.bool_])
def test_array_source_rejects_non_integer_labels(dtype):
    with pytest.raises(ValueError, match=r"ArraySource 'arrays': field 'label' has dtype") as info:
        ArraySource({"label": np.zeros(3, dtype)})
    assert "astype(np.int32)" in str(info.value)


def test_array_source_only_checks_the_label_field():
    source = ArraySource({"y": np.array([-1, 5]), "target": np.array([0.5, 2.0])}, num_classes=2)
    assert len(source) == 2


def test_ignore_label_is_admitted_and_must_not_be_a_class():
    source = ArraySource(labelled([3, -1, 9]), num_classes=10, ignore_label=-1)
    np.testing.assert_array_equal(source.arrays["label"], [3, -1, 9])
    with pytest.raises(ValueError, match=r"label -2 at index 1"):
        ArraySource(labelled([3, -2, 9]), num_classes=10, ignore_label=-1)
    with pytest.raises(ValueError, match=r"ignore_label=3 is one of the classes \[0, 10\)"):
        ArraySource(labelled([3]), num_classes=10, ignore_label=3)
    with pytest.raises(ValueError, match=r"ignore_label=255 cannot be told apart"):
        ArraySource(labelled([3]), ignore_label=255)
    with pytest.raises(ValueError, match=r"num_classes must be an int >= 1, got 0"):
        ArraySource(labelled([0]), num_classes=0)


@pytest.mark.parametrize(("value", "num_classes"), [(-1, 10), (-1, None), (10, 10)])
def test_load_npz_rejects_bad_labels_naming_the_file(tmp_path, value, num_classes):
    path = tmp_path / "d.npz"
    np.savez(path, label=np.array([1, value]), image=np.zeros((2, 3)))
    with pytest.raises(ValueError) as info:
        load_npz(path, num_classes=num_classes)
    assert_label_error(str(info.value), str(path), value, "index 1")


def test_load_npz_keeps_valid_data_unchanged(tmp_path):
    arrays = labelled([1, 0, 2])
    np.savez(tmp_path / "d.npz", image=arrays["image"], label=arrays["label"])
    source = load_npz(tmp_path / "d.npz", num_classes=3)
    assert source.num_classes == 3
    for key, value in arrays.items():
        np.testing.assert_array_equal(source.arrays[key], value)
    np.savez(tmp_path / "f.npz", label=np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"f\.npz: field 'label' has dtype float64"):
        load_npz(tmp_path / "f.npz")
    np.savez(tmp_path / "i.npz", label=np.array([1, -1]))
    assert load_npz(tmp_path / "i.npz", num_classes=3, ignore_label=-1).ignore_label == -1


def test_file_readers_set_num_classes(tmp_path):
    write_mnist(tmp_path / "mnist")
    write_cifar10(tmp_path / "c10")
    write_cifar100(tmp_path / "c100")
    assert mnist(tmp_path / "mnist", "test").num_classes == 10
    assert cifar10(tmp_path / "c10", "test").num_classes == 10
    assert cifar100(tmp_path / "c100", "test").num_classes == 100
    assert cifar100(tmp_path / "c100", "test", label="coarse").num_classes == 20
    assert digits("test").num_classes == 10
    assert synthetic(4, (2,), num_classes=3).num_classes == 3


@pytest.mark.parametrize("value", [-1, 10])
def test_cifar_rejects_labels_outside_the_classes(tmp_path, value):
    write_cifar10(tmp_path)
    write_pickle(
        tmp_path / "test_batch", cifar_batch(3, np.random.default_rng(0), labels=[0, 4, value])
    )
    with pytest.raises(ValueError) as info:
        cifar10(tmp_path, "test")
    assert_label_error(str(info.value), str(tmp_path / "test_batch"), value, "index 2")


def test_array_record_keeps_num_classes_and_checks_labels_as_it_reads(tmp_path):
    source = ArraySource(labelled([0, 2, 1, 2]), num_classes=3)
    path = write_array_record(source, tmp_path / "s.array_record")
    assert json.loads(sidecar_path(path).read_text())["num_classes"] == 3
    read = ArrayRecordSource(path)
    assert read.num_classes == 3 and read.ignore_label is None
    assert_same_records(source, read)
    with pytest.raises(ValueError) as info:  # an explicit num_classes wins over the sidecar
        ArrayRecordSource(path, num_classes=2).getitems([0, 1, 3])
    assert_label_error(str(info.value), str(path), 2, "record 1")
    assert "outside the classes [0, 2)" in str(info.value)
    with pytest.raises(ValueError) as info:
        ArrayRecordSource(path, num_classes=2)[3]
    assert_label_error(str(info.value), str(path), 2, "record 3")
    assert int(ArrayRecordSource(path, num_classes=2)[0]["label"]) == 0  # valid records read


def test_array_record_rejects_negative_labels_on_read_and_write(tmp_path):
    source = ArraySource(labelled([0, -1, 5]), ignore_label=-1)
    path = write_array_record(source, tmp_path / "s.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    assert spec["ignore_label"] == -1 and "num_classes" not in spec
    assert_same_records(source, ArrayRecordSource(path))
    del spec["ignore_label"]
    sidecar_path(path).write_text(json.dumps(spec))
    read = ArrayRecordSource(path)
    assert int(read[2]["label"]) == 5
    with pytest.raises(ValueError) as info:
        read[1]
    assert_label_error(str(info.value), str(path), -1, "record 1")
    with pytest.raises(ValueError, match=r"label -1 at record 1"):
        read.getitems(np.array([2, 1, 0]))

    class Unchecked:
        """A source of its own: nothing checked its labels before the writer."""

        fingerprint = "unchecked"
        num_classes = 10

        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> dict[str, np.ndarray]:
            return {"label": np.asarray([4, 11, 2][index], np.int32)}

    with pytest.raises(ValueError) as info:
        write_array_record(Unchecked(), tmp_path / "u.array_record")
    assert_label_error(str(info.value), "Unchecked written to", 11, "example 1")
    assert not (tmp_path / "u.array_record").exists()


def test_array_record_rejects_a_float_label_field_and_bad_sidecar_entries(tmp_path):
    path = write_array_record(ArraySource({"x": np.arange(3.0)}), tmp_path / "f.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    spec["fields"][0]["name"] = "label"
    sidecar_path(path).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"f\.array_record\.json: field 'label' has dtype float64"):
        ArrayRecordSource(path)
    path = write_array_record(ArraySource(labelled([0, 1])), tmp_path / "s.array_record")
    spec = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**spec, "num_classes": "10"}))
    with pytest.raises(ValueError, match=r"s\.array_record\.json has num_classes='10'"):
        ArrayRecordSource(path)


# ------------------------------------------------------------ CIFAR pickles run no code


class RunsCode:
    """A pickle payload: unpickling it calls ``function(*args)``."""

    def __init__(self, function: object, *args: object):
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.function, self.args


def payloads(marker: Path) -> dict[str, RunsCode]:
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return {
        "os.system": RunsCode(os.system, f"touch {marker}"),
        "builtins.eval": RunsCode(builtins.eval, touch),
        "builtins.exec": RunsCode(builtins.exec, touch),
    }


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "builtins.exec"])
@pytest.mark.parametrize("where", ["whole", "label", "data"])
def test_cifar_pickle_that_calls_a_function_is_refused_and_runs_nothing(tmp_path, payload, where):
    marker = tmp_path / "ran"
    evil = payloads(marker)[payload]
    write_cifar10(tmp_path)
    batch = cifar_batch(2, np.random.default_rng(0), labels=[0, 1])
    content = (
        evil if where == "whole" else {**batch, {"label": b"labels", "data": b"data"}[where]: evil}
    )
    write_pickle(tmp_path / "test_batch", content)
    with pytest.raises(ValueError) as info:
        cifar10(tmp_path, "test")
    message = str(info.value)
    module, name = payload.split(".")
    module = os.system.__module__ if module == "os" else module
    assert str(tmp_path / "test_batch") in message and f"{module}.{name}" in message, message
    assert "refused" in message and "official CIFAR archive" in message
    assert not marker.exists()


def test_cifar_pickle_refused_by_the_converter_too(tmp_path):
    marker = tmp_path / "ran"
    write_cifar10(tmp_path / "raw")
    write_pickle(tmp_path / "raw" / "data_batch_3", payloads(marker)["os.system"])
    done = run_cli("cifar10", "--data-dir", str(tmp_path / "raw"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "data_batch_3 was refused" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert "restricted unpickler" in " ".join(run_cli("--help").stdout.split())


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_cifar_pickles_of_every_protocol_still_read(tmp_path, protocol):
    """Arrays, bytes keys, int and numpy-int label lists, as any writer may pickle them."""
    batch = cifar_batch(3, np.random.default_rng(0), labels=[4, 0, 9])
    batch[b"filenames"] = [b"a.png", b"b.png", b"c.png"]
    batch[b"batch_label"] = b"testing batch 1 of 1"
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=protocol))
    got = all_records(cifar10(tmp_path, "test"))
    np.testing.assert_array_equal(got["image"], chw_to_hwc_by_hand(np.asarray(batch[b"data"])))
    np.testing.assert_array_equal(got["label"], [4, 0, 9])
    batch[b"labels"] = list(np.array([1, 2, 3], np.int64))  # numpy scalars
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=protocol))
    np.testing.assert_array_equal(all_records(cifar10(tmp_path, "test"))["label"], [1, 2, 3])


def test_cifar_pickle_written_by_numpy_1_reads(tmp_path):
    """numpy 1.x names ``numpy.core.multiarray``; the official files were written so."""
    batch = cifar_batch(2, np.random.default_rng(0), labels=[7, 1])
    data = pickle.dumps(batch, protocol=2)
    assert b"numpy._core.multiarray" in data
    (tmp_path / "test_batch").write_bytes(data.replace(b"numpy._core.", b"numpy.core."))
    got = all_records(cifar10(tmp_path, "test"))
    np.testing.assert_array_equal(got["image"], chw_to_hwc_by_hand(np.asarray(batch[b"data"])))
    np.testing.assert_array_equal(got["label"], [7, 1])
