"""ResNet v1.5 (He et al., 2016, with the stride on the 3×3 convolution) with batch norm.

The layer shapes are those of the reference ImageNet models (11,689,512 parameters for
ResNet-18, 21,797,672 for ResNet-34, 25,557,032 for ResNet-50 with 1000 classes); a
``"cifar"`` stem and a ``width`` multiplier adapt them to small images and quick tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshkit.models._remat import RematPolicy, remat_block, remat_policy

Stem = Literal["imagenet", "cifar"]


def _conv_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """He normal over the fan-out: std ``sqrt(2 / (kh * kw * out))``, as in the reference.

    Drawn as a flat vector and reshaped: the same distribution, and XLA on CPU compiles
    a flat draw many times faster than a 4-D one (seconds per kernel otherwise).
    """
    fan_out = math.prod(shape[:-2]) * shape[-1]
    flat = jax.random.normal(key, (math.prod(shape),), dtype)
    return (math.sqrt(2.0 / fan_out) * flat).reshape(shape)


_BN_MOMENTUM = 0.9  # running average = 0.9 * old + 0.1 * batch
_BN_EPSILON = 1e-5


def _norm(train: bool, dtype: Any, *, zero: bool = False, name: str | None = None) -> nn.BatchNorm:
    """Batch norm: batch statistics in training, running averages otherwise.

    ``zero`` starts the scale at 0, so a residual block begins as the identity.
    """
    return nn.BatchNorm(
        use_running_average=not train,
        momentum=_BN_MOMENTUM,
        epsilon=_BN_EPSILON,
        dtype=dtype,
        scale_init=nn.initializers.zeros if zero else nn.initializers.ones,
        name=name,
    )


def _conv(features: int, size: int, stride: int, dtype: Any, name: str) -> nn.Conv:
    """A bias-free convolution, padded by ``size // 2`` on every side."""
    pad = size // 2
    return nn.Conv(
        features,
        (size, size),
        strides=(stride, stride),
        padding=((pad, pad), (pad, pad)),
        use_bias=False,
        kernel_init=_conv_init,
        dtype=dtype,
        name=name,
    )


class BasicBlock(nn.Module):
    """Two 3×3 convolutions and a shortcut (ResNet-18 and -34); ``features`` out.

    ``train`` may be passed by position, as ``nn.remat`` needs for a static argument.
    """

    features: int
    stride: int = 1
    zero_init_residual: bool = False
    dtype: Any = None

    expansion: ClassVar[int] = 1

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, train: bool = False) -> jax.Array:
        out = self.features * self.expansion
        y = _conv(self.features, 3, self.stride, self.dtype, "conv1")(x_BxHxWxC)
        y = nn.relu(_norm(train, self.dtype, name="bn1")(y))
        y = _conv(out, 3, 1, self.dtype, "conv2")(y)
        y = _norm(train, self.dtype, zero=self.zero_init_residual, name="bn2")(y)
        return nn.relu(y + _shortcut(x_BxHxWxC, out, self.stride, train, self.dtype))


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (strided: v1.5), 1×1 expand by 4, and a shortcut (ResNet-50).

    ``train`` may be passed by position, as ``nn.remat`` needs for a static argument.
    """

    features: int
    stride: int = 1
    zero_init_residual: bool = False
    dtype: Any = None

    expansion: ClassVar[int] = 4

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, train: bool = False) -> jax.Array:
        out = self.features * self.expansion
        y = _conv(self.features, 1, 1, self.dtype, "conv1")(x_BxHxWxC)
        y = nn.relu(_norm(train, self.dtype, name="bn1")(y))
        y = _conv(self.features, 3, self.stride, self.dtype, "conv2")(y)
        y = nn.relu(_norm(train, self.dtype, name="bn2")(y))
        y = _conv(out, 1, 1, self.dtype, "conv3")(y)
        y = _norm(train, self.dtype, zero=self.zero_init_residual, name="bn3")(y)
        return nn.relu(y + _shortcut(x_BxHxWxC, out, self.stride, train, self.dtype))


def _shortcut(x: jax.Array, features: int, stride: int, train: bool, dtype: Any) -> jax.Array:
    """The identity, or a strided 1×1 projection with batch norm where the shape changes.

    Called inside a block's compact ``__call__``, so its layers belong to the block.
    """
    if stride == 1 and x.shape[-1] == features:
        return x
    x = _conv(features, 1, stride, dtype, "downsample_conv")(x)
    return _norm(train, dtype, name="downsample_bn")(x)


class ResNet(nn.Module):
    """ResNet v1.5: a stem, four stages of residual blocks, global average pool, dense head.

    Stage ``i`` has ``stage_sizes[i]`` blocks of ``width * 2**i`` features (times the
    block's expansion); stages 2-4 halve the resolution in their first block, on its 3×3
    convolution (v1.5). Shortcuts are identities, or 1×1 projections with batch norm
    where the shape changes.

    Batch norm uses batch statistics with ``train=True`` (updating the running averages
    in ``batch_stats``, so apply with ``mutable=["batch_stats"]``) and the running
    averages with ``train=False``. Under ``jax.jit`` with a sharded batch the statistics
    are those of the whole global batch. With ``zero_init_residual`` the last batch norm
    of every residual block starts with scale 0, so each block starts as the identity,
    which helps large-batch ImageNet training (Goyal et al., 2017); it is off by default,
    as in torchvision, because it slows small runs down a lot (ResNet-18 at width 16 on
    the digits: 78% training accuracy after 40 steps with it, 98% without).

    Attributes:
      stage_sizes: blocks per stage.
      block: ``BasicBlock`` (ResNet-18, -34) or ``Bottleneck`` (ResNet-50 and deeper).
      num_classes: outputs of the dense head.
      width: features of the first stage (64 in the reference models); smaller values
        make quick tests.
      stem: ``"imagenet"``: 7×7 stride-2 convolution and 3×3 stride-2 max pool (a
        224×224 image reaches the first stage at 56×56); ``"cifar"``: one 3×3 stride-1
        convolution, no pool (for 32×32 images).
      zero_init_residual: start the last batch-norm scale of each block at 0 (off by
        default).
      dtype: the compute dtype; ``None`` follows the inputs and parameters (so
        ``create_train_state(..., precision="bf16")`` decides), ``jnp.bfloat16``
        computes in bfloat16 with float32 parameters.
      remat: what each residual block keeps for the backward pass (a
        ``RematPolicy``); the running averages in ``batch_stats`` update as they do without.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = ResNet18(num_classes=10, stem="cifar", width=16)
        >>> variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        >>> sorted(variables), variables["params"]["head"]["kernel"].shape
        (['batch_stats', 'params'], (128, 10))
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    block: type[BasicBlock] | type[Bottleneck] = BasicBlock
    num_classes: int = 1000
    width: int = 64
    stem: Stem = "imagenet"
    zero_init_residual: bool = False
    dtype: Any = None
    remat: RematPolicy = "none"

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        remat_policy(self.remat)
        if self.stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {self.stem!r}.")
        if x_BxHxWxC.ndim != 4:
            raise ValueError(
                f"{type(self).__name__} expects images of shape (batch, height, width, "
                f"channels), got shape {x_BxHxWxC.shape}."
            )
        x = jnp.asarray(x_BxHxWxC, self.dtype) if self.dtype is not None else x_BxHxWxC
        if self.stem == "imagenet":
            x = _conv(self.width, 7, 2, self.dtype, "stem_conv")(x)
            x = nn.relu(_norm(train, self.dtype, name="stem_bn")(x))
            pad = ((1, 1), (1, 1))  # flax's annotation says str; pairs are supported
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=pad)  # pyright: ignore[reportArgumentType]
        else:
            x = _conv(self.width, 3, 1, self.dtype, "stem_conv")(x)
            x = nn.relu(_norm(train, self.dtype, name="stem_bn")(x))
        block = remat_block(self.block, self.remat, scanned=False)
        for stage, blocks in enumerate(self.stage_sizes):
            for index in range(blocks):
                x = block(
                    features=self.width * 2**stage,
                    stride=2 if stage > 0 and index == 0 else 1,
                    zero_init_residual=self.zero_init_residual,
                    dtype=self.dtype,
                    name=f"stage{stage + 1}_block{index + 1}",
                )(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


class ResNet18(ResNet):
    """ResNet-18: ``BasicBlock`` stages of 2, 2, 2, 2 blocks (11.7 M parameters at 1000 classes).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> out = jax.eval_shape(lambda x: ResNet18(num_classes=10).init_with_output(
        ...     jax.random.key(0), x)[0], jnp.zeros((2, 224, 224, 3)))
        >>> out.shape
        (2, 10)
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    block: type[BasicBlock] | type[Bottleneck] = BasicBlock


class ResNet34(ResNet):
    """ResNet-34: ``BasicBlock`` stages of 3, 4, 6, 3 blocks (21.8 M parameters)."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block: type[BasicBlock] | type[Bottleneck] = BasicBlock


class ResNet50(ResNet):
    """ResNet-50: ``Bottleneck`` stages of 3, 4, 6, 3 blocks (25.6 M parameters)."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block: type[BasicBlock] | type[Bottleneck] = Bottleneck
