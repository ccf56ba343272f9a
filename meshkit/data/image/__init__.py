"""Image operations and classification transforms for input pipelines (numpy + Pillow).

Two parts: the operations (``decode``, ``encode``, ``resize``, the crops,
``horizontal_flip``, ``normalize``) work on one image; the transforms
(``train_transform``, ``eval_transform``) assemble them into the usual classification
transforms for ``TrainPipeline(transform=...)`` and ``EvalPipeline(transform=...)``, as
small frozen dataclasses that pickle, so Grain worker processes can run them.

Every random operation takes a ``np.random.Generator`` and draws from it in a fixed
order, so the pipeline's per-example generator (seeded by the example's global
position) makes augmentation exact and independent of the process layout.

Images are ``uint8`` arrays of shape ``(height, width, channels)``; sizes are an
``int`` (a square) or a ``(height, width)`` pair.

Examples:
    >>> import numpy as np
    >>> from meshkit.data import image
    >>> rng = np.random.default_rng(0)
    >>> pixels = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    >>> transform = image.train_transform(32, mean=image.IMAGENET_MEAN, std=image.IMAGENET_STD)
    >>> out = transform({"image": image.encode(pixels), "label": np.int64(3)}, rng)
    >>> out["image"].shape, out["image"].dtype, out["label"].dtype
    ((32, 32, 3), dtype('float32'), dtype('int32'))
"""

from meshkit.data.image._device import DecodeTransform as DecodeTransform
from meshkit.data.image._device import DeviceAugmentation as DeviceAugmentation
from meshkit.data.image._device import decode_transform as decode_transform
from meshkit.data.image._device import device_augmentation as device_augmentation
from meshkit.data.image._ops import CIFAR10_MEAN as CIFAR10_MEAN
from meshkit.data.image._ops import CIFAR10_STD as CIFAR10_STD
from meshkit.data.image._ops import IMAGENET_MEAN as IMAGENET_MEAN
from meshkit.data.image._ops import IMAGENET_STD as IMAGENET_STD
from meshkit.data.image._ops import center_crop as center_crop
from meshkit.data.image._ops import decode as decode
from meshkit.data.image._ops import decode_and_random_crop as decode_and_random_crop
from meshkit.data.image._ops import encode as encode
from meshkit.data.image._ops import horizontal_flip as horizontal_flip
from meshkit.data.image._ops import normalize as normalize
from meshkit.data.image._ops import random_crop as random_crop
from meshkit.data.image._ops import random_crop_box as random_crop_box
from meshkit.data.image._ops import random_resized_crop as random_resized_crop
from meshkit.data.image._ops import resize as resize
from meshkit.data.image._settings import DECODE_BOUND_SIDE as DECODE_BOUND_SIDE
from meshkit.data.image._settings import input_settings as input_settings
from meshkit.data.image._transforms import EvalTransform as EvalTransform
from meshkit.data.image._transforms import TrainTransform as TrainTransform
from meshkit.data.image._transforms import eval_transform as eval_transform
from meshkit.data.image._transforms import train_transform as train_transform

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DECODE_BOUND_SIDE",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DecodeTransform",
    "DeviceAugmentation",
    "EvalTransform",
    "TrainTransform",
    "center_crop",
    "decode",
    "decode_and_random_crop",
    "decode_transform",
    "device_augmentation",
    "encode",
    "eval_transform",
    "horizontal_flip",
    "input_settings",
    "normalize",
    "random_crop",
    "random_crop_box",
    "random_resized_crop",
    "resize",
    "train_transform",
]
