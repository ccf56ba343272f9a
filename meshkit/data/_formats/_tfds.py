"""TensorFlow Datasets' ArrayRecord data, read without TensorFlow (optional package).

TFDS writes each example as a serialised ``tf.train.Example`` protobuf, one record per
example, in files ``<name>-<split>.array_record-00000-of-00004``. With
``file_format="array_record"`` its ``tfds.data_source`` reads them with random access,
parsing the protos with ``protobuf`` and numpy and decoding images with Pillow: the
``tensorflow-datasets`` package is needed, TensorFlow is not. :class:`TfdsSource`
wraps that data source as a meshkit source and, by default, leaves images encoded
(``tfds.decode.SkipDecoding``) so that the per-example transform decodes them.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data._labels import LABEL_FIELD, check_labels


def _import_tfds() -> Any:
    try:
        return importlib.import_module("tensorflow_datasets")
    except ImportError as error:
        raise ImportError(
            "TfdsSource needs the tensorflow-datasets package (TensorFlow itself is not "
            "needed to read ArrayRecord data): pip install tensorflow-datasets."
        ) from error


def _first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (TFDS's messages list every known data set)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _value(value: Any, class_label: bool) -> Any:
    """numpy for what TFDS returns as Python numbers; bytes and arrays as they are."""
    if class_label:
        return np.int32(value)
    if isinstance(value, bytes | np.ndarray | dict):
        return value
    return np.asarray(value)


class TfdsSource:
    """One split of a TFDS data set prepared with ``file_format="array_record"``.

    Examples are TFDS's, field by field: images as their encoded bytes (unless
    ``decode_images=True``), a ``ClassLabel`` as int32, other numbers as numpy arrays.
    A ``"label"`` ``ClassLabel`` gives ``num_classes`` and ``class_names``, and labels
    are checked as they are read. The source pickles (Grain workers reopen the files).

    Args:
        name: A TFDS name (``"mnist"``, ``"imagenet2012:5.1.0"``) found under
            ``data_dir``, or the folder of a prepared version
            (``~/tensorflow_datasets/mnist/3.0.1``), which needs no builder code.
        split: A split name or TFDS split expression (``"train"``, ``"train[:90%]"``).
        data_dir: TFDS's data folder (default: TFDS's own, ``~/tensorflow_datasets``).
        decode_images: Decode ``Image`` features to uint8 arrays here (Pillow) instead
            of returning their bytes.

    Raises:
        ImportError: ``tensorflow-datasets`` is not installed.
        FileNotFoundError: The data set is not prepared under ``data_dir``.
        ValueError: It was prepared in another file format (TFRecord), or TFDS refused
            the split.
    """

    def __init__(
        self,
        name: str,
        *,
        split: str,
        data_dir: str | Path | None = None,
        decode_images: bool = False,
    ):
        tfds = _import_tfds()
        folder = None if data_dir is None else str(Path(data_dir).expanduser())
        try:
            if Path(name).expanduser().is_dir():  # a prepared version: no builder code needed
                builder = tfds.builder_from_directory(str(Path(name).expanduser()))
            else:
                builder = tfds.builder(name, data_dir=folder)
            info = builder.info
            features = info.features
            if not info.splits:
                raise FileNotFoundError("the builder is known but its data is not prepared")
        except Exception as error:  # TFDS raises several types for a missing data set
            raise FileNotFoundError(
                f"TFDS found no prepared data set {name!r} under {folder or 'its default'} "
                f"data_dir ({_first_line(error)}). Prepare it once with "
                f"`tfds build {name} --file_format=array_record` (on a machine with "
                "TensorFlow if the builder needs it), then pass that data_dir."
            ) from None
        images = [key for key, value in features.items() if isinstance(value, tfds.features.Image)]
        decoders = None if decode_images else {key: tfds.decode.SkipDecoding() for key in images}
        try:
            self._source: Any = builder.as_data_source(split=split, decoders=decoders)
        except Exception as error:  # NotImplementedError for TFRecord files, and others
            raise ValueError(
                f"TFDS cannot open split {split!r} of {info.full_name} as a data source "
                f"({_first_line(error)}). Data sources need "
                "file_format='array_record': rebuild it with `tfds build "
                f"{name} --file_format=array_record`, or check the split name "
                f"({sorted(info.splits)})."
            ) from None
        self.name, self.split, self.decode_images = info.full_name, split, decode_images
        self._class_labels = frozenset(
            key for key, value in features.items() if isinstance(value, tfds.features.ClassLabel)
        )
        label = features[LABEL_FIELD] if LABEL_FIELD in self._class_labels else None
        self.num_classes: int | None = None if label is None else int(label.num_classes)
        self.class_names: tuple[str, ...] | None = None if label is None else tuple(label.names)
        self.ignore_label: int | None = None
        self._length = len(self._source)
        digest = hashlib.sha1(
            f"{info.full_name}|{split}|{self._length}|{decode_images}|"
            f"{[(s, info.splits[s].shard_lengths) for s in sorted(info.splits)]}".encode()
        )
        self._fingerprint = f"tfds:{info.full_name}:{split}:{digest.hexdigest()[:16]}"

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        images = "images decoded" if self.decode_images else "images encoded"
        return f"TfdsSource({self.name}, split={self.split!r}, {self._length} examples, {images})"

    @property
    def fingerprint(self) -> str:
        """A hash of the data set's full name (with version), the split and its shard lengths."""
        return self._fingerprint

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = int(index) + (self._length if index < 0 else 0)
        if not 0 <= key < self._length:
            raise IndexError(f"Index {index} is out of range for {self._length} examples.")
        try:
            example = self._source[key]
        except Exception as error:  # a damaged record or an undecodable image
            raise ValueError(
                f"Example {key} of {self.name} split {self.split!r} cannot be read "
                f"({_first_line(error)}). Prepare the data set again with "
                "`tfds build`."
            ) from None
        out = {k: _value(v, k in self._class_labels) for k, v in example.items()}
        if LABEL_FIELD in self._class_labels:
            check_labels(
                np.asarray(out[LABEL_FIELD])[None],
                where=f"{self.name} {self.split}",
                num_classes=self.num_classes,
                indices=np.array([key]),
                item="record",
            )
        return out
