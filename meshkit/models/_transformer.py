"""A decoder-only Transformer whose parameters and activations carry logical axis names.

Every parameter is created through ``nn.with_logical_partitioning`` and every large
activation passes through ``nn.with_logical_constraint``, so one table from logical
names to mesh axes (``{"embed": "data", "mlp": "model", ...}``) decides the whole
layout: FSDP, tensor parallelism, or both. Without such a table the constraints do
nothing and the model runs on one device like any other.

Logical names, and the dimensions they label (symbols of the shape suffixes):

=========  ====================================================  ======
name       dimension                                             symbol
=========  ====================================================  ======
``batch``  examples of a batch (activations only)                B
``length`` positions of a sequence (activations only)            L
``vocab``  the token vocabulary                                  V
``embed``  the model width, ``embed_dim``                        D
``mlp``    the hidden width of the MLP blocks, ``mlp_dim``       F
``heads``  attention heads, ``num_heads``                        H
``kv``     the width of one head, ``embed_dim // num_heads``     K
``layers`` the blocks of a scanned model (parameters only)       N
=========  ====================================================  ======

With ``scan_layers=True`` every parameter of the blocks carries ``layers`` first
(``layers/attention/query/kernel: (layers, embed, heads, kv)``), so a logical table
used with a scanned model needs a ``"layers"`` entry, normally ``None`` (every device
holds all the layers, each sharded as the other names say).
"""

from __future__ import annotations

import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from meshkit.models._attention import (
    AttentionImplementation,
    check_implementation,
    check_weights_kept,
    dot_product_attention,
)
from meshkit.models._remat import RematPolicy, remat_block, remat_policy, scan_blocks

_INIT_STDDEV = 0.02


def _normal(*names: str | None) -> nn.initializers.Initializer:
    """A normal(0.02) initializer whose parameter carries the logical ``names``."""
    return nn.with_logical_partitioning(nn.initializers.normal(_INIT_STDDEV), names)


def _zeros(*names: str | None) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(*names: str | None) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def _layer_norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(scale_init=_ones("embed"), bias_init=_zeros("embed"), name=name)


def sinusoidal_positions(length: int, width: int) -> jax.Array:
    """The fixed position codes of "Attention Is All You Need", ``[length, width]``.

    Column ``2i`` holds ``sin(p / 10000^(2i / width))`` and column ``2i + 1`` the
    cosine, for position ``p``.

    Examples:
        >>> sinusoidal_positions(4, 6).shape
        (4, 6)
    """
    position_Lx1 = jnp.arange(length, dtype=jnp.float32)[:, None]
    frequency_W = jnp.exp(-math.log(10000.0) * jnp.arange(0, width, 2) / width)
    angle_LxW = position_Lx1 * frequency_W[None, :]
    codes = jnp.stack([jnp.sin(angle_LxW), jnp.cos(angle_LxW)], axis=-1)
    return codes.reshape(length, -1)[:, :width]


class Einsum(nn.Module):
    """``einsum(equation, x, kernel) + bias``: a dense layer over several dimensions at once.

    The kernel has shape ``shape`` and logical ``names``; the bias, when ``bias_names``
    is given, covers the last ``len(bias_names)`` dimensions of the kernel. (Flax's
    ``nn.DenseGeneral`` initializes a flattened kernel and reshapes it, which a
    logical constraint active during ``init`` refuses.)
    """

    equation: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    bias_names: tuple[str | None, ...] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _normal(*self.names), self.shape)
        y = jnp.einsum(self.equation, x, kernel.astype(x.dtype))
        if self.bias_names is None:
            return y
        bias_shape = self.shape[len(self.shape) - len(self.bias_names) :]
        bias = self.param("bias", _zeros(*self.bias_names), bias_shape)
        return y + bias.astype(y.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` attends to positions ``<= t``.

    The key projection has no bias: it would add the same amount to every logit of
    a query, which the softmax cancels, so its gradient is zero.
    """

    num_heads: int
    dropout_rate: float = 0.0
    implementation: AttentionImplementation = "auto"

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, *, train: bool = False) -> jax.Array:
        width = x_BxLxD.shape[-1]
        head_dim = width // self.num_heads
        heads = ("batch", "length", "heads", "kv")

        def project(name: str) -> jax.Array:
            y_BxLxHxK = Einsum(
                "bld,dhk->blhk",
                (width, self.num_heads, head_dim),
                ("embed", "heads", "kv"),
                None if name == "key" else ("heads", "kv"),
                name=name,
            )(x_BxLxD)
            return nn.with_logical_constraint(y_BxLxHxK, heads)

        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (project(n) for n in ("query", "key", "value"))
        if train and self.dropout_rate > 0:  # dropout on the weights: they must exist
            check_weights_kept(self.implementation, where="Transformer")
            logits_BxHxLxL = jnp.einsum("bqhk,bthk->bhqt", q_BxLxHxK, k_BxLxHxK) / math.sqrt(
                head_dim
            )
            length = x_BxLxD.shape[1]
            causal_LxL = jnp.tril(jnp.ones((length, length), bool))
            logits_BxHxLxL = jnp.where(causal_LxL, logits_BxHxLxL.astype(jnp.float32), -jnp.inf)
            weights_BxHxLxL = jax.nn.softmax(logits_BxHxLxL, axis=-1).astype(x_BxLxD.dtype)
            weights_BxHxLxL = nn.Dropout(self.dropout_rate, deterministic=False)(weights_BxHxLxL)
            mixed_BxLxHxK = jnp.einsum("bhqt,bthk->bqhk", weights_BxHxLxL, v_BxLxHxK)
        else:
            mixed_BxLxHxK = dot_product_attention(
                q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, causal=True, implementation=self.implementation
            )
        mixed_BxLxHxK = nn.with_logical_constraint(mixed_BxLxHxK, heads)
        return Einsum(
            "blhk,hkd->bld",
            (self.num_heads, head_dim, width),
            ("heads", "kv", "embed"),
            ("embed",),
            name="out",
        )(mixed_BxLxHxK)


class Mlp(nn.Module):
    """Dense to ``mlp_dim``, GELU, dense back to the model width."""

    mlp_dim: int

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxF = nn.Dense(
            self.mlp_dim, kernel_init=_normal("embed", "mlp"), bias_init=_zeros("mlp"), name="up"
        )(x_BxLxD)
        h_BxLxF = nn.with_logical_constraint(nn.gelu(h_BxLxF), ("batch", "length", "mlp"))
        return nn.Dense(
            x_BxLxD.shape[-1],
            kernel_init=_normal("mlp", "embed"),
            bias_init=_zeros("embed"),
            name="down",
        )(h_BxLxF)


class Block(nn.Module):
    """One pre-LayerNorm layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    ``train`` may be passed by position, as ``nn.remat`` needs for a static argument.
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention: AttentionImplementation = "auto"

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, train: bool = False) -> jax.Array:
        dropout = nn.Dropout(self.dropout_rate, deterministic=not train)
        attention = CausalSelfAttention(
            self.num_heads, self.dropout_rate, self.attention, name="attention"
        )
        x_BxLxD = x_BxLxD + dropout(attention(_layer_norm("attention_norm")(x_BxLxD), train=train))
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
        mlp = Mlp(self.mlp_dim, name="mlp")
        x_BxLxD = x_BxLxD + dropout(mlp(_layer_norm("mlp_norm")(x_BxLxD)))
        return nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))


class Transformer(nn.Module):
    """A decoder-only (GPT-style) Transformer: token ids ``[B, L]`` to logits ``[B, L, V]``.

    Token embedding plus position codes, ``num_layers`` pre-LayerNorm blocks of causal
    self-attention and a GELU MLP, a final LayerNorm, and logits from the token
    embedding itself (``tie_embeddings``) or from a separate output matrix. Logits at
    position ``t`` depend on tokens ``0..t`` only. Parameters carry the logical names
    of this module's table (``embed/embedding: (vocab, embed)``,
    ``query/kernel: (embed, heads, kv)``, ``mlp/up/kernel: (embed, mlp)``, ...).

    Attributes:
      vocab_size: token ids lie in ``[0, vocab_size)``; 256 for bytes.
      num_layers: Transformer blocks.
      num_heads: attention heads; must divide ``embed_dim``.
      embed_dim: the model width.
      mlp_dim: the hidden width of each MLP.
      max_length: the longest input; learned position codes have this many rows.
      dropout_rate: dropout on embeddings, attention weights and block outputs, in
        training only.
      positions: ``"learned"`` (a trained ``[max_length, embed_dim]`` table) or
        ``"sinusoidal"`` (fixed codes, no parameters).
      tie_embeddings: compute logits with the token embedding (``x @ embedding.T``)
        instead of a separate ``[embed_dim, vocab_size]`` matrix.
      remat: what each block keeps for the backward pass (a ``RematPolicy``);
        ``"none"`` keeps everything, ``"nothing_saveable"`` recomputes each block.
      scan_layers: run the blocks as one ``nn.scan`` over parameters stacked along a
        leading ``layers`` dimension (``params/layers/...`` instead of
        ``params/block_0/...``), so the compiled program does not grow with
        ``num_layers``.
      attention: how attention is computed (``meshkit.models.dot_product_attention``):
        ``"auto"`` (cuDNN's fused kernel on GPUs for 16-bit compute, the Pallas flash
        kernel on TPUs, XLA elsewhere), ``"xla"``, ``"cudnn"`` or ``"pallas"``. The
        fused kernels store no ``[length, length]`` weights; with attention dropout in
        training the weights must exist, so ``"auto"`` and ``"xla"`` compute them and
        the fused kernels are refused.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> model = Transformer(vocab_size=256, num_layers=2, num_heads=4, embed_dim=32,
        ...                     mlp_dim=64, max_length=16)
        >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
        >>> model.apply(variables, jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
        >>> specs = nn.get_partition_spec(variables)["params"]
        >>> specs["embed"]["embedding"], specs["block_0"]["attention"]["query"]["kernel"]
        (P('vocab', 'embed'), P('embed', 'heads', 'kv'))

        The same model with its blocks scanned and recomputed in the backward pass:

        >>> scanned = model.clone(scan_layers=True, remat="nothing_saveable")
        >>> variables = jax.eval_shape(scanned.init, jax.random.key(0),
        ...                            jnp.zeros((1, 16), jnp.int32))
        >>> nn.get_partition_spec(variables)["params"]["layers"]["attention"]["query"]["kernel"]
        P('layers', 'embed', 'heads', 'kv')
    """

    vocab_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 128
    mlp_dim: int = 512
    max_length: int = 128
    dropout_rate: float = 0.0
    positions: Literal["learned", "sinusoidal"] = "learned"
    tie_embeddings: bool = True
    remat: RematPolicy = "none"
    scan_layers: bool = False
    attention: AttentionImplementation = "auto"

    def _check(self, tokens_BxL: jax.Array) -> None:
        remat_policy(self.remat)
        check_implementation(self.attention, where="Transformer")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"Transformer embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; pick num_heads among the divisors of embed_dim."
            )
        if self.positions not in ("learned", "sinusoidal"):
            raise ValueError(
                f"Transformer positions must be 'learned' or 'sinusoidal'; got {self.positions!r}."
            )
        try:  # concrete ids (outside a jit): say which one is wrong
            ids = np.asarray(tokens_BxL)
        except jax.errors.TracerArrayConversionError:
            ids = None  # traced: out-of-vocabulary ids give NaN in __call__
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = np.argwhere((ids < 0) | (ids >= self.vocab_size))[0]
            raise ValueError(
                f"Transformer got token id {int(ids[tuple(bad)])} at position "
                f"{tuple(int(i) for i in bad)}, outside the vocabulary [0, "
                f"{self.vocab_size}); check the tokenizer, or build the model with "
                "vocab_size covering every id."
            )
        if tokens_BxL.ndim != 2 or tokens_BxL.shape[1] > self.max_length:
            raise ValueError(
                f"Transformer takes token ids of shape [batch, length] with length <= "
                f"max_length={self.max_length}; got shape {tokens_BxL.shape}. Cut the "
                "input into windows, or build the model with a larger max_length."
            )

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array, *, train: bool = False) -> jax.Array:
        self._check(tokens_BxL)
        length = tokens_BxL.shape[1]
        embed = nn.Embed(
            self.vocab_size, self.embed_dim, embedding_init=_normal("vocab", "embed"), name="embed"
        )
        x_BxLxD = embed(jnp.clip(tokens_BxL, 0, self.vocab_size - 1))
        # An id outside the vocabulary would read another row (-5) or NaN (vocab_size
        # and up) without a word: NaN for both, which fit stops on and names.
        known_BxL = (tokens_BxL >= 0) & (tokens_BxL < self.vocab_size)
        x_BxLxD = jnp.where(known_BxL[..., None], x_BxLxD, jnp.nan)
        if self.positions == "learned":
            table_LxD = self.param(
                "position_embedding",
                _normal(None, "embed"),
                (self.max_length, self.embed_dim),
            )
            x_BxLxD = x_BxLxD + table_LxD[:length].astype(x_BxLxD.dtype)
        else:
            x_BxLxD = x_BxLxD + sinusoidal_positions(length, self.embed_dim).astype(x_BxLxD.dtype)
        x_BxLxD = nn.Dropout(self.dropout_rate, deterministic=not train)(x_BxLxD)
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
        block = remat_block(Block, self.remat, scanned=self.scan_layers)
        if self.scan_layers:
            layers = block(
                self.num_heads, self.mlp_dim, self.dropout_rate, self.attention, name="layers"
            )
            x_BxLxD = scan_blocks(layers, x_BxLxD, train, length=self.num_layers)
        else:
            for layer in range(self.num_layers):
                layer_block = block(
                    self.num_heads,
                    self.mlp_dim,
                    self.dropout_rate,
                    self.attention,
                    name=f"block_{layer}",
                )
                x_BxLxD = layer_block(x_BxLxD, train)
        x_BxLxD = _layer_norm("final_norm")(x_BxLxD)
        if self.tie_embeddings:
            logits_BxLxV = embed.attend(x_BxLxD)
        else:
            logits_BxLxV = nn.Dense(
                self.vocab_size,
                kernel_init=_normal("embed", "vocab"),
                bias_init=_zeros("vocab"),
                name="head",
            )(x_BxLxD)
        return nn.with_logical_constraint(logits_BxLxV, ("batch", "length", "vocab"))
