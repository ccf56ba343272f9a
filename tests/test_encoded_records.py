"""Encoded-record ArrayRecord files: image records, their writers, the converter, the source.

Pixels are decoded here with Pillow directly (an independent reference), never with
the code under test.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from meshkit.data import (
    ArrayRecordSource,
    EncodedRecordSource,
    Source,
    decode_image_record,
    digits,
    encode_image_record,
    image_records,
    write_digits_images,
    write_image_folder,
    write_image_records,
)
from meshkit.data import image as image_ops
from meshkit.data._formats._array_record import sidecar_path
from meshkit.data.convert import main

pytestmark = pytest.mark.once  # files and bytes: no devices involved


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image)


def random_images(n: int = 6, shape: tuple[int, ...] = (5, 7, 3), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def smooth_images(n: int = 4, size: int = 16) -> np.ndarray:
    """Gradients JPEG keeps within a few levels (random noise it does not)."""
    ramp = np.linspace(0, 255, size)
    base = (ramp[:, None, None] + ramp[None, :, None] * np.array([0.2, 0.5, 0.8])) / 2
    return np.stack([np.roll(base, 3 * i, axis=0) for i in range(n)]).astype(np.uint8)


def test_image_record_round_trips_as_a_two_key_msgpack_map():
    data = encode_image_record(b"\xff\xd8\xff\xe0jpeg-bytes", 3)
    assert msgpack.unpackb(data) == {"image": b"\xff\xd8\xff\xe0jpeg-bytes", "label": 3}
    record = decode_image_record(data)
    assert record["image"] == b"\xff\xd8\xff\xe0jpeg-bytes"
    assert record["label"].dtype == np.int32
    assert record["label"] == 3
    for bad, found in [
        (msgpack.packb({"image": b"x"}), r"\['image'\]"),
        (msgpack.packb({"image": "text", "label": 1}), "str and int"),
        (msgpack.packb([1, 2]), "list"),
        (b"\xc1", "not a msgpack image record"),
    ]:
        with pytest.raises(ValueError, match=found):
            decode_image_record(bad)


def test_png_records_round_trip_exactly(tmp_path):
    images = random_images()
    labels = np.array([0, 4, 2, 2, 1, 3])
    (path,) = write_image_records(tmp_path / "a.array_record", images, labels, format="png")
    source = image_records(path)
    assert isinstance(source, Source)
    assert len(source) == 6 and source.num_classes == 5 and source.class_names is None
    for i in range(6):
        np.testing.assert_array_equal(pixels(source[i]["image"]), images[i])
        assert source[i]["label"] == labels[i]
    np.testing.assert_array_equal(pixels(source[-1]["image"]), images[-1])
    with pytest.raises(IndexError, match="Index 6 is out of range for 6 records"):
        source[6]
    spec = json.loads(sidecar_path(path).read_text())
    assert spec["format"] == "meshkit.image_records.v1" and spec["image_format"] == "png"
    assert spec["shards"] == [{"file": "a.array_record", "count": 6}]
    assert "EncodedRecordSource(" in repr(source) and "6 records, 5 classes" in repr(source)


def test_jpeg_records_round_trip_within_tolerance_and_bytes_are_kept(tmp_path):
    images = smooth_images()
    buffer = io.BytesIO()
    Image.fromarray(images[0]).save(buffer, format="PNG")
    encoded = [buffer.getvalue(), *images[1:]]  # one already-encoded PNG among arrays
    (path,) = write_image_records(
        tmp_path / "j.array_record", encoded, [1, 0, 1, 0], quality=95, class_names=["a", "b"]
    )
    source = image_records(path)
    assert source.class_names == ("a", "b") and source.num_classes == 2
    assert source[0]["image"] == encoded[0]  # bytes given are stored as they are
    for i in range(1, 4):
        assert source[i]["image"][:3] == b"\xff\xd8\xff"
        error = np.abs(pixels(source[i]["image"]).astype(int) - images[i]).mean()
        assert error < 2.0, error
    assert json.loads(sidecar_path(path).read_text())["image_format"] == "mixed"


def test_writer_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="Image 1 is 3 bytes starting b'GIF'"):
        write_image_records(tmp_path / "x", [b"\x89PNG\r\n\x1a\n", b"GIF"], [0, 1])
    with pytest.raises(
        ValueError, match=r"Image 0 \(float32\[4, 4, 3\]\) cannot be encoded as jpeg"
    ):
        write_image_records(tmp_path / "x", np.zeros((1, 4, 4, 3), np.float32), [0])
    with pytest.raises(ValueError, match="label 2 at index 1 is outside the classes"):
        write_image_records(tmp_path / "x", random_images(2), [0, 2], num_classes=2)
    with pytest.raises(ValueError, match="Got 2 images and labels of shape"):
        write_image_records(tmp_path / "x", random_images(2), [0])
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_shards_read_in_the_order_of_the_unsharded_file(tmp_path):
    images, labels = random_images(10), np.arange(10) % 4
    (whole,) = write_image_records(tmp_path / "whole.array_record", images, labels, format="png")
    shards = write_image_records(
        tmp_path / "s.array_record", images, labels, format="png", num_shards=3
    )
    assert [p.name for p in shards] == [f"s.array_record-0000{i}-of-00003" for i in range(3)]
    one, three = image_records(whole), image_records(tmp_path / "s.array_record")
    globbed = EncodedRecordSource(
        str(tmp_path / "s.array_record-*"), decode=decode_image_record, num_classes=4
    )
    assert len(one) == len(three) == len(globbed) == 10
    for i in range(10):
        assert one[i]["image"] == three[i]["image"] == globbed[i]["image"]
        assert one[i]["label"] == three[i]["label"] == labels[i]
    assert "3 files" in repr(three)
    order = [7, 0, 9, 3, 3, 5]  # across the shards, one twice: a batch's read
    batch = three.examples(order)
    assert [r["image"] for r in batch] == [one[i]["image"] for i in order]
    assert [int(r["label"]) for r in batch] == [labels[i] for i in order]


def corrupt_record_file(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Three shards of good records; record 1 of the second shard is not msgpack."""
    records = [encode_image_record(b"\x89PNG\r\n\x1a\n" + bytes([i]), i) for i in range(6)]
    records[3] = b"\xc1not msgpack"
    paths = []
    for shard in range(3):
        paths.append(tmp_path / f"c-{shard}")
        writer = ArrayRecordWriter(str(paths[-1]), "group_size:1")
        for record in records[2 * shard : 2 * shard + 2]:
            writer.write(record)
        writer.close()
    return paths[1], paths


def test_an_undecodable_record_names_its_index_file_and_cause(tmp_path):
    bad_file, paths = corrupt_record_file(tmp_path)
    source = EncodedRecordSource(paths, decode=decode_image_record)
    assert [int(source[i]["label"]) for i in (0, 1, 2, 4, 5)] == [0, 1, 2, 4, 5]
    for read in (lambda: source[3], lambda: source.examples([0, 5, 3, 1])):
        with pytest.raises(ValueError) as info:
            read()
        message = str(info.value)
        assert f"Record 3 ({bad_file}, its record 1) cannot be decoded" in message, message
        assert "decode_image_record" in message and "not a msgpack image record" in message


def test_a_damaged_file_names_the_record_or_the_file(tmp_path):
    payload = bytes(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8))
    path = tmp_path / "d.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
    for i in range(4):
        writer.write(bytes([i]) + payload)
    writer.close()
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(bytes([2]) + payload)
    data[offset + 9] ^= 0xFF  # inside record 2: its chunk's checksum fails
    path.write_bytes(bytes(data))
    source = EncodedRecordSource(path, decode=lambda data: {"n": np.int32(data[0])})
    assert int(source[1]["n"]) == 1
    with pytest.raises(ValueError, match=rf"Record 2 of {path} cannot be read .* damaged"):
        source[2]
    with pytest.raises(ValueError, match=rf"Record 2 of {path} cannot be read .* damaged"):
        source.examples([0, 1, 2, 3])  # a batch's read names the damaged record too
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(ValueError, match=rf"{path} is not a readable ArrayRecord file"):
        EncodedRecordSource(path, decode=decode_image_record)
    with pytest.raises(FileNotFoundError, match=r"matches no file"):
        EncodedRecordSource(str(tmp_path / "none-*"), decode=decode_image_record)


def test_labels_are_checked_as_records_are_read(tmp_path):
    (path,) = write_image_records(tmp_path / "l", random_images(3), [0, 1, 2], format="png")
    source = EncodedRecordSource(path, decode=decode_image_record, num_classes=2)
    assert int(source[1]["label"]) == 1
    with pytest.raises(ValueError, match=r"label 2 at record 2 is outside the classes \[0, 2\)"):
        source[2]
    with pytest.raises(ValueError, match=r"label 2 at record 2 is outside the classes \[0, 2\)"):
        source.examples([1, 0, 2])


def test_a_batch_read_across_files_names_the_file_of_a_bad_label(tmp_path):
    shards = write_image_records(
        tmp_path / "s", random_images(6), [0, 1, 0, 1, 0, 5], format="png", num_shards=3
    )
    source = EncodedRecordSource(shards, decode=decode_image_record, num_classes=2)
    assert [int(r["label"]) for r in source.examples([0, 1, 2, 3, 4])] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match=rf"{shards[2].name} .*: label 5 at record 5 is outside"):
        source.examples([0, 2, 5, 3])


def test_pickled_source_reopens_its_files_and_reads_the_same(tmp_path):
    (path,) = write_image_records(tmp_path / "p", random_images(4), [0, 1, 2, 3], format="png")
    source = image_records(path)
    first = source[2]
    restored = pickle.loads(pickle.dumps(source))
    assert restored.fingerprint == source.fingerprint and restored.class_names is None
    assert restored[2]["image"] == first["image"] and restored[2]["label"] == 2
    assert len(pickle.dumps(source)) < 2000  # paths and counts, no reader or record bytes
    local = EncodedRecordSource(path, decode=lambda data: {"raw": data})
    with pytest.raises(TypeError, match=r"decode .*<lambda> cannot be pickled .* module level"):
        pickle.dumps(local)


def test_fingerprint_follows_the_data(tmp_path):
    images = random_images(4)
    (path,) = write_image_records(tmp_path / "a", images, [0, 1, 2, 3], format="png")
    before = image_records(path).fingerprint
    assert before == image_records(path).fingerprint
    size = path.stat().st_size
    write_image_records(tmp_path / "a", images, [0, 1, 3, 2], format="png")
    assert path.stat().st_size == size  # same size, other labels
    assert image_records(path).fingerprint != before
    other_decode = EncodedRecordSource(path, decode=lambda data: {"raw": data})
    assert other_decode.fingerprint != image_records(path).fingerprint


def write_folder(root: Path) -> dict[str, list[np.ndarray]]:
    """root/<class>/*.png in an order where sorted class names differ from creation order."""
    rng = np.random.default_rng(1)
    folders = {"zebra": 2, "ant": 3, "moth": 1}
    written = {}
    for name, count in folders.items():
        (root / name).mkdir(parents=True)
        written[name] = []
        for i in range(count):
            image = rng.integers(0, 256, (4 + i, 6, 3), dtype=np.uint8)
            Image.fromarray(image).save(root / name / f"img{i}.png")
            written[name].append(image)
    (root / "ant" / "notes.txt").write_text("not an image")
    return written


def test_image_folder_round_trip_with_sorted_class_indices(tmp_path):
    written = write_folder(tmp_path / "folder")
    paths = write_image_folder(tmp_path / "folder", tmp_path / "out" / "train.array_record")
    source = image_records(paths[0])
    assert source.class_names == ("ant", "moth", "zebra") and source.num_classes == 3
    expected = [(label, image) for label, name in enumerate(("ant", "moth", "zebra"))
                for image in written[name]]  # fmt: skip
    assert len(source) == len(expected) == 6
    for i, (label, image) in enumerate(expected):
        assert int(source[i]["label"]) == label
        np.testing.assert_array_equal(pixels(source[i]["image"]), image)
    assert source[0]["image"] == (tmp_path / "folder" / "ant" / "img0.png").read_bytes()
    assert json.loads(sidecar_path(paths[0]).read_text())["skipped_files"] == 1


def test_image_folder_reencodes_only_when_asked_and_names_a_bad_file(tmp_path):
    write_folder(tmp_path / "folder")
    (path,) = write_image_folder(tmp_path / "folder", tmp_path / "j", reencode="jpeg")
    assert image_records(path)[0]["image"][:3] == b"\xff\xd8\xff"
    (tmp_path / "folder" / "moth" / "fake.jpg").write_bytes(b"GIF89a....")
    with pytest.raises(ValueError, match=r"moth/fake\.jpg is not a JPEG or PNG file"):
        write_image_folder(tmp_path / "folder", tmp_path / "k")
    assert not list(tmp_path.glob("k*"))


def test_a_cut_short_image_is_named_at_conversion_unless_told_not_to_verify(tmp_path, capsys):
    write_folder(tmp_path / "folder")
    good = tmp_path / "folder" / "ant" / "img0.png"
    cut = tmp_path / "folder" / "ant" / "img9.jpg"
    jpeg = image_ops.encode(np.full((32, 32, 3), 200, np.uint8), format="jpeg")
    cut.write_bytes(jpeg[: len(jpeg) // 2])  # right magic bytes, half the data
    with pytest.raises(ValueError, match=r"ant/img9\.jpg could not be decoded .*--no-verify"):
        write_image_folder(tmp_path / "folder", tmp_path / "v")
    out = tmp_path / "w.array_record"
    argv = ["images", "--from-folder", str(tmp_path / "folder"), "--out", str(out)]
    with pytest.raises(SystemExit):
        main(argv)
    assert "img9.jpg could not be decoded" in capsys.readouterr().err
    assert main([*argv, "--no-verify"]) == 0 and len(image_records(out)) == 7
    assert good.exists()


def test_a_test_folder_missing_a_class_keeps_the_training_indices(tmp_path, capsys):
    write_folder(tmp_path / "train")
    (tmp_path / "test" / "zebra").mkdir(parents=True)  # no "ant", no "moth" images
    Image.fromarray(random_images(1)[0]).save(tmp_path / "test" / "zebra" / "z.png")
    train = tmp_path / "out" / "train.array_record"
    test = tmp_path / "out" / "test.array_record"
    main(["images", "--from-folder", str(tmp_path / "train"), "--out", str(train)])
    alone = write_image_folder(tmp_path / "test", tmp_path / "alone")[0]
    assert int(image_records(alone)[0]["label"]) == 0  # sorted folders alone: zebra is 0
    args = ["--from-folder", str(tmp_path / "test"), "--out", str(test)]
    assert main(["images", *args, "--class-names-from", str(train)]) == 0
    records = image_records(test)
    assert records.class_names == ("ant", "moth", "zebra") and records.num_classes == 3
    assert len(records) == 1 and int(records[0]["label"]) == 2
    (tmp_path / "test" / "wolf").mkdir()
    with pytest.raises(ValueError, match=r"class folders \['wolf'\] that are not among the 3"):
        write_image_folder(tmp_path / "test", test, class_names=("ant", "moth", "zebra"))


def test_digits_images_keep_the_digits_split(tmp_path):
    paths = write_digits_images(tmp_path, size=16, format="png", splits=["test"])
    source = image_records(paths["test"])
    reference = digits("test")
    assert len(source) == len(reference) == 360 and source.class_names == tuple("0123456789")
    for i in (0, 17, 359):
        image = pixels(source[i]["image"])
        assert image.shape == (16, 16, 3) and (image[..., 0] == image[..., 2]).all()
        assert int(source[i]["label"]) == int(reference[i]["label"])
        # The mean brightness survives bilinear enlargement (rows of the matrix sum to 1).
        assert abs(image.mean() / 255 - reference[i]["image"].mean()) < 0.02


def test_cli_converts_digits_folders_and_keeps_fixed_shape_output(tmp_path, capsys):
    assert main(["digits", "--encoded", "jpeg", "--size", "32", "--rgb", "--out",
                 str(tmp_path / "d"), "--shards", "2"]) == 0  # fmt: skip
    output = capsys.readouterr().out
    assert f"wrote {tmp_path / 'd' / 'train.array_record'}: 1,437 records in 2 files" in output
    train = image_records(tmp_path / "d" / "train.array_record")
    assert len(train) == 1437 and pixels(train[5]["image"]).shape == (32, 32, 3)
    assert main(["digits", "--out", str(tmp_path / "fixed")]) == 0
    assert len(ArrayRecordSource(tmp_path / "fixed" / "test.array_record")) == 360
    write_folder(tmp_path / "folder")
    out = tmp_path / "f" / "train.array_record"
    assert main(["images", "--from-folder", str(tmp_path / "folder"), "--out", str(out)]) == 0
    assert "6 records" in capsys.readouterr().out and len(image_records(out)) == 6
    with pytest.raises(SystemExit):
        main(["digits", "--size", "32", "--out", str(tmp_path / "x")])
    assert "apply to encoded image records only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["images", "--from-folder", str(tmp_path / "absent"), "--out", str(out)])
    assert "No folder at" in capsys.readouterr().err


def test_image_records_without_a_sidecar_or_with_another_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="EncodedRecordSource"):
        image_records(tmp_path / "absent")
    main(["digits", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"open it with meshkit\.data\.ArrayRecordSource"):
        image_records(tmp_path / "test.array_record")
    (images,) = write_image_records(tmp_path / "i", random_images(2), [0, 1], format="png")
    with pytest.raises(ValueError, match=r"describes encoded image records.*image_records\(path\)"):
        ArrayRecordSource(images)


def test_tfds_source_without_the_package_says_what_to_install(monkeypatch):
    from meshkit.data import TfdsSource

    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        TfdsSource("mnist", split="train")


def prepare_tfds_set(tfds, data_dir: Path, images: np.ndarray, labels: list[int]) -> str:
    """A TFDS data set of PNG images in ArrayRecord files, built without TensorFlow."""

    class MeshkitTinyImages(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = {
                "image": tfds.features.Image(shape=images.shape[1:]),
                "label": tfds.features.ClassLabel(names=["cat", "dog", "fox"]),
            }
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict(features)
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, (image, label) in enumerate(zip(images, labels, strict=True)):
                buffer = io.BytesIO()  # encoded files pass through; arrays would need TF
                Image.fromarray(image).save(buffer, format="PNG")
                buffer.seek(0)
                yield i, {"image": buffer, "label": label}

    builder = MeshkitTinyImages(data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare()
    return builder.info.full_name


def test_tfds_array_record_data_reads_without_tensorflow(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    from meshkit.data import TfdsSource

    images, labels = random_images(5, (4, 6, 3)), [2, 0, 1, 1, 0]
    name = prepare_tfds_set(tfds, tmp_path, images, labels)
    assert name == "meshkit_tiny_images/1.0.0"
    # The prepared folder, as if copied from where it was built: no builder class needed
    # (and none to pickle for Grain's workers).
    source = TfdsSource(str(tmp_path / name), split="train")
    assert len(source) == 5 and source.num_classes == 3
    assert source.class_names == ("cat", "dog", "fox")
    # TFDS shuffles examples as it writes them: match them up by their pixels.
    found = sorted(
        (pixels(source[i]["image"]).tobytes(), int(source[i]["label"])) for i in range(5)
    )
    assert found == sorted(zip((image.tobytes() for image in images), labels, strict=True))
    assert source[0]["label"].dtype == np.int32
    restored = pickle.loads(pickle.dumps(source))
    assert restored[3]["image"] == source[3]["image"]
    assert restored.fingerprint == source.fingerprint
    decoded = TfdsSource("meshkit_tiny_images", split="train[:2]", data_dir=tmp_path,
                         decode_images=True)  # fmt: skip
    assert len(decoded) == 2 and decoded.class_names == source.class_names
    np.testing.assert_array_equal(decoded[1]["image"], pixels(source[1]["image"]))
    assert decoded.fingerprint != source.fingerprint
    assert "tensorflow" not in sys.modules
    with pytest.raises(FileNotFoundError, match="tfds build absent --file_format=array_record"):
        TfdsSource("absent", split="train", data_dir=tmp_path)


def png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("batched", [True, False])
def test_an_image_that_fails_in_the_transform_names_its_record_and_file(tmp_path, batched):
    # The record is well formed (msgpack, PNG magic) but its pixels are cut short: the
    # failure comes from the training transform, far from the source that read it.
    import jax

    import meshkit
    from meshkit.data import TrainPipeline

    good = [png_bytes(image) for image in smooth_images(8)]
    good[5] = good[5][:40]  # a PNG cut short: header intact, pixels gone
    path = tmp_path / "train.array_record"
    write_image_records(path, good, list(range(8)), format="png", num_classes=8)
    source = image_records(path)
    transform = image_ops.train_transform((8, 8), mean=0.5, std=0.25)
    if not batched:
        transform = functools.partial(transform)  # no .batch: one example at a time
    mesh = meshkit.make_mesh("data=1", devices=jax.devices()[:1])
    pipeline = TrainPipeline(
        source, global_batch_size=8, sharding=meshkit.batch_sharding(mesh), transform=transform
    )
    with pytest.raises(Exception) as info:  # whatever the decoder raises, kept as it is
        pipeline.local_batch(0)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"Record 5 of {path}" in notes, notes
    assert "source index 5 of EncodedRecordSource(" in notes, notes
