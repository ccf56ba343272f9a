"""Vision Transformer (Dosovitskiy et al., 2021): patches, a pre-LN Transformer encoder, a head.

With ``pool="token"`` the layer shapes are those of the reference models: ViT-Ti/16 at
224×224 with 1000 classes has 5,717,416 parameters, ViT-S/16 22,050,664.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshkit.models._attention import (
    AttentionImplementation,
    check_implementation,
    flax_attention_fn,
)
from meshkit.models._remat import RematPolicy, remat_block, remat_policy, scan_blocks

Pool = Literal["token", "gap"]

_DENSE_INIT = nn.initializers.xavier_uniform()


def _flat(initializer: Any) -> Any:
    """``initializer`` on the 2-D view ``(prod(shape[:-1]), shape[-1])``, reshaped.

    For fan-in scaled and elementwise initializers the distribution is the same; XLA on
    CPU compiles a 2-D random draw many times faster than a 3-D or 4-D one.
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return initializer(key, (math.prod(shape[:-1]), shape[-1]), dtype).reshape(shape)

    return init


_PATCH_INIT = _flat(nn.initializers.lecun_normal())
_POS_INIT = _flat(nn.initializers.normal(stddev=0.02))


class MlpBlock(nn.Module):
    """Dense to ``mlp_dim``, GELU, dropout, dense back to the input width, dropout."""

    mlp_dim: int
    dropout_rate: float = 0.0
    dtype: Any = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, *, train: bool = False) -> jax.Array:
        bias_init = nn.initializers.normal(1e-6)
        h_BxLxF = nn.Dense(
            self.mlp_dim,
            dtype=self.dtype,
            kernel_init=_DENSE_INIT,
            bias_init=bias_init,
            name="fc1",
        )(x_BxLxD)
        h_BxLxF = nn.gelu(h_BxLxF, approximate=False)
        h_BxLxF = nn.Dropout(self.dropout_rate, deterministic=not train)(h_BxLxF)
        y_BxLxD = nn.Dense(
            x_BxLxD.shape[-1],
            dtype=self.dtype,
            kernel_init=_DENSE_INIT,
            bias_init=bias_init,
            name="fc2",
        )(h_BxLxF)
        return nn.Dropout(self.dropout_rate, deterministic=not train)(y_BxLxD)


class EncoderBlock(nn.Module):
    """Pre-LN Transformer block: ``x + MHA(LN(x))``, then ``x + MLP(LN(x))``.

    ``train`` may be passed by position, as ``nn.remat`` needs for a static argument.
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Any = None
    attention: AttentionImplementation = "auto"

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, train: bool = False) -> jax.Array:
        h = nn.LayerNorm(dtype=self.dtype, name="norm1")(x_BxLxD)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            kernel_init=_DENSE_INIT,
            dropout_rate=self.attention_dropout_rate,
            deterministic=not train,
            attention_fn=flax_attention_fn(self.attention),
            name="attention",
        )(h)
        x_BxLxD = x_BxLxD + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm(dtype=self.dtype, name="norm2")(x_BxLxD)
        h = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, name="mlp")(h, train=train)
        return x_BxLxD + h


class ViT(nn.Module):
    """Vision Transformer: patch embedding, position embeddings, pre-LN encoder, head.

    The image is cut into ``patch_size``² patches by a strided convolution; with
    ``pool="token"`` a learned class token is prepended and its final state feeds the
    head, with ``pool="gap"`` the head sees the mean of the patch tokens. Learned
    position embeddings cover every token, so their number follows the image size
    the model is initialised with (``(H / patch_size) · (W / patch_size)`` patches,
    plus the class token); ``image_size``, when given, is checked against the input.
    The encoder's blocks are pre-LN, a final LayerNorm precedes the pooling, and the
    head starts at zero (the initial loss is ``log(num_classes)``).

    ``dropout_rate`` applies after the embeddings, inside the MLPs and on each residual
    branch, ``attention_dropout_rate`` to the attention weights; both only with
    ``train=True`` (apply with ``rngs={"dropout": key}``).

    Attributes:
      num_classes: outputs of the head.
      patch_size: side of the square patches; must divide the image's sides.
      embed_dim: token width (D).
      depth: number of encoder blocks.
      num_heads: attention heads; must divide ``embed_dim``.
      mlp_dim: hidden width of the MLPs.
      pool: ``"token"`` (class token) or ``"gap"`` (global average of the tokens).
      dropout_rate: dropout on embeddings, MLPs and residual branches.
      attention_dropout_rate: dropout on the attention weights.
      image_size: when set, the input's height and width must equal it.
      dtype: the compute dtype; ``None`` follows the inputs and parameters.
      remat: what each encoder block keeps for the backward pass (a ``RematPolicy``).
      scan_layers: run the encoder blocks as one ``nn.scan`` over parameters stacked
        along a leading dimension of size ``depth`` (``params/layers/...`` instead of
        ``params/block1/...``).
      attention: how attention is computed, as in ``Transformer`` (``"auto"``,
        ``"xla"``, ``"cudnn"``, ``"pallas"``); with attention dropout in training
        Flax's own attention runs (the fused kernels are refused).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = ViT(num_classes=10, patch_size=4, embed_dim=32, depth=2, num_heads=2,
        ...             mlp_dim=64)
        >>> variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
        >>> variables["params"]["pos_embedding"].shape  # 8 × 8 patches + the class token
        (1, 65, 32)
    """

    num_classes: int = 1000
    patch_size: int = 4
    embed_dim: int = 192
    depth: int = 12
    num_heads: int = 3
    mlp_dim: int = 768
    pool: Pool = "token"
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    image_size: int | None = None
    dtype: Any = None
    remat: RematPolicy = "none"
    scan_layers: bool = False
    attention: AttentionImplementation = "auto"

    def _check(self, shape: tuple[int, ...]) -> None:
        name = type(self).__name__
        remat_policy(self.remat)
        check_implementation(self.attention, where=name)
        if self.pool not in ("token", "gap"):
            raise ValueError(f"pool must be 'token' or 'gap', got {self.pool!r}.")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"{name}: embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; choose num_heads among its divisors."
            )
        if len(shape) != 4:
            raise ValueError(
                f"{name} expects images of shape (batch, height, width, channels), got "
                f"shape {shape}."
            )
        height, width = shape[1:3]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"{name}: patch_size={self.patch_size} does not divide the image size "
                f"{height}×{width}; resize the images or pick a patch size that divides both."
            )
        if self.image_size is not None and (height, width) != (self.image_size,) * 2:
            raise ValueError(
                f"{name} was built for {self.image_size}×{self.image_size} images "
                f"(image_size={self.image_size}), got {height}×{width}. Pass "
                f"image_size={height} (the position embeddings follow the image size)."
            )

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        self._check(tuple(x_BxHxWxC.shape))
        x = jnp.asarray(x_BxHxWxC, self.dtype) if self.dtype is not None else x_BxHxWxC
        p = self.patch_size
        x = nn.Conv(
            self.embed_dim,
            (p, p),
            strides=(p, p),
            padding="VALID",
            dtype=self.dtype,
            kernel_init=_PATCH_INIT,
            name="patch_embedding",
        )(x)
        batch, rows, cols, dim = x.shape
        x_BxLxD = x.reshape(batch, rows * cols, dim)
        if self.pool == "token":
            cls_1x1xD = self.param("cls_token", nn.initializers.zeros, (1, 1, dim))
            cls_Bx1xD = jnp.broadcast_to(cls_1x1xD, (batch, 1, dim)).astype(x_BxLxD.dtype)
            x_BxLxD = jnp.concatenate([cls_Bx1xD, x_BxLxD], axis=1)
        pos_1xLxD = self.param("pos_embedding", _POS_INIT, (1, *x_BxLxD.shape[1:]))
        x_BxLxD = x_BxLxD + pos_1xLxD.astype(x_BxLxD.dtype)
        x_BxLxD = nn.Dropout(self.dropout_rate, deterministic=not train)(x_BxLxD)
        block = remat_block(EncoderBlock, self.remat, scanned=self.scan_layers)
        settings = {
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "dtype": self.dtype,
            "attention": self.attention,
        }
        if self.scan_layers:
            layers = block(**settings, name="layers")
            x_BxLxD = scan_blocks(layers, x_BxLxD, train, length=self.depth)
        else:
            for index in range(self.depth):
                x_BxLxD = block(**settings, name=f"block{index + 1}")(x_BxLxD, train)
        x_BxLxD = nn.LayerNorm(dtype=self.dtype, name="norm")(x_BxLxD)
        x_BxD = x_BxLxD[:, 0] if self.pool == "token" else jnp.mean(x_BxLxD, axis=1)
        return nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros, name="head"
        )(x_BxD)


class ViTTiny(ViT):
    """ViT-Ti: width 192, 12 blocks, 3 heads, MLP 768 (patch 4 by default, for 32×32 images).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> out = jax.eval_shape(lambda x: ViTTiny(num_classes=10).init_with_output(
        ...     jax.random.key(0), x)[0], jnp.zeros((2, 32, 32, 3)))
        >>> out.shape
        (2, 10)
    """

    embed_dim: int = 192
    depth: int = 12
    num_heads: int = 3
    mlp_dim: int = 768


class ViTSmall(ViT):
    """ViT-S: width 384, 12 blocks, 6 heads, MLP 1536 (patch 4 by default, for 32×32 images)."""

    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    mlp_dim: int = 1536
