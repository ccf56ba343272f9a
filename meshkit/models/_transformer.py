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
``kv_heads`` key and value heads, ``num_kv_heads`` (grouped      G
           queries; ``heads`` when every head has its own)
``kv``     the width of one head, ``embed_dim // num_heads``     K
``layers`` the blocks of a scanned model (parameters only)       N
=========  ====================================================  ======

With ``scan_layers=True`` every parameter of the blocks carries ``layers`` first
(``layers/attention/query/kernel: (layers, embed, heads, kv)``), so a logical table
used with a scanned model needs a ``"layers"`` entry, normally ``None`` (every device
holds all the layers, each sharded as the other names say).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from meshkit.models import _tied as tied
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


Norm = Literal["layer", "rms"]
"""``"layer"``: LayerNorm (scale and bias, GPT); ``"rms"``: RMSNorm (scale only, LLaMA)."""

MlpKind = Literal["gelu", "swiglu"]
"""``"gelu"``: up, GELU, down (GPT); ``"swiglu"``: ``down(silu(gate(x)) * up(x))`` (LLaMA)."""


def _norm(
    kind: Norm, name: str, param_dtype: Any = jnp.float32, epsilon: float | None = None
) -> nn.Module:
    if kind == "rms":  # LLaMA's epsilon unless told
        return nn.RMSNorm(
            epsilon=1e-5 if epsilon is None else epsilon,
            scale_init=_ones("embed"),
            param_dtype=param_dtype,
            name=name,
        )
    return nn.LayerNorm(
        epsilon=1e-6 if epsilon is None else epsilon,
        scale_init=_ones("embed"),
        bias_init=_zeros("embed"),
        param_dtype=param_dtype,
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of the rotary frequencies for contexts longer than trained.

    Frequencies whose wavelength is shorter than ``original_max_length /
    high_freq_factor`` positions stay; those longer than ``original_max_length /
    low_freq_factor`` are divided by ``factor``; those between move smoothly from one
    to the other (the ``"llama3"`` rope type of the published configurations).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_length: int = 8192


def rope_frequencies(
    width: int, base: float = 10000.0, scaling: RopeScaling | None = None
) -> jax.Array:
    """The rotary frequencies of a head of ``width``: ``base^(-2i / width)`` for each
    pair ``i``, stretched by ``scaling`` where given.

    Examples:
        >>> rope_frequencies(4)
        Array([1.  , 0.01], dtype=float32)
    """
    frequency_W = 1.0 / base ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width)
    if scaling is None:
        return frequency_W
    wavelength_W = 2 * math.pi / frequency_W
    old = scaling.original_max_length
    stretched_W = jnp.where(
        wavelength_W > old / scaling.low_freq_factor, frequency_W / scaling.factor, frequency_W
    )
    smooth_W = (old / wavelength_W - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between_W = (wavelength_W >= old / scaling.high_freq_factor) & (
        wavelength_W <= old / scaling.low_freq_factor
    )
    smoothed_W = (1 - smooth_W) * stretched_W / scaling.factor + smooth_W * stretched_W
    return jnp.where(between_W, smoothed_W, stretched_W)


def rotary_embedding(
    x_BxLxHxK: jax.Array,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    offset: jax.Array | int = 0,
) -> jax.Array:
    """Rotary position embedding (RoFormer; as LLaMA applies it to queries and keys).

    Each head's width ``K`` is split in two halves ``(a, b)``; at position ``p`` the pair
    ``(a_i, b_i)`` is rotated by the angle ``p * base^(-2i / K)`` (``rope_frequencies``,
    stretched by ``scaling`` where given). The product of a query at position ``m`` and
    a key at ``n`` then depends on ``m - n`` only. The first position is ``offset`` (a
    decoding step's place in its sequence).

    Examples:
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> y = rotary_embedding(x)
        >>> y.shape, bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0: no rotation
        ((1, 3, 2, 4), True)
    """
    length, width = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
    if width % 2:
        raise ValueError(f"Rotary embedding needs an even head width; got {width}.")
    frequency_W = rope_frequencies(width, base, scaling)
    position_L = offset + jnp.arange(length, dtype=jnp.float32)
    angle_LxW = position_L[:, None] * frequency_W[None, :]
    cos_Lx1xW = jnp.cos(angle_LxW)[:, None, :]
    sin_Lx1xW = jnp.sin(angle_LxW)[:, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    a, b = x[..., : width // 2], x[..., width // 2 :]
    rotated = jnp.concatenate([a * cos_Lx1xW - b * sin_Lx1xW, a * sin_Lx1xW + b * cos_Lx1xW], -1)
    return rotated.astype(x_BxLxHxK.dtype)


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
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _normal(*self.names), self.shape, self.param_dtype)
        y = jnp.einsum(self.equation, x, kernel.astype(x.dtype))
        if self.bias_names is None:
            return y
        bias_shape = self.shape[len(self.shape) - len(self.bias_names) :]
        bias = self.param("bias", _zeros(*self.bias_names), bias_shape, self.param_dtype)
        return y + bias.astype(y.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` attends to positions ``<= t``.

    With ``num_kv_heads`` below ``num_heads`` (grouped-query attention) each key and
    value head serves ``num_heads // num_kv_heads`` query heads. With ``rope_base``
    the queries and keys are rotated by their position (``rotary_embedding``). Without
    ``use_bias`` no projection has a bias; with it, the key projection still has none:
    it would add the same amount to every logit of a query, which the softmax cancels,
    so its gradient is zero. Each head is ``head_dim`` wide (``None``: the model width
    over ``num_heads``).
    """

    num_heads: int
    dropout_rate: float = 0.0
    implementation: AttentionImplementation = "auto"
    num_kv_heads: int | None = None
    rope_base: float | None = None
    use_bias: bool = True
    param_dtype: Any = jnp.float32
    rope_scaling: RopeScaling | None = None
    decode: bool = False
    head_dim: int | None = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, *, train: bool = False) -> jax.Array:
        width = x_BxLxD.shape[-1]
        head_dim = self.head_dim or width // self.num_heads
        kv_heads = self.num_kv_heads or self.num_heads
        grouped = kv_heads != self.num_heads
        heads = ("batch", "length", "heads", "kv")

        def project(name: str, count: int, head_name: str) -> jax.Array:
            biased = self.use_bias and name != "key"
            y_BxLxHxK = Einsum(
                "bld,dhk->blhk",
                (width, count, head_dim),
                ("embed", head_name, "kv"),
                (head_name, "kv") if biased else None,
                self.param_dtype,
                name=name,
            )(x_BxLxD)
            if head_name == "heads":
                y_BxLxHxK = nn.with_logical_constraint(y_BxLxHxK, heads)
            return y_BxLxHxK

        kv_name = "kv_heads" if grouped else "heads"
        q_BxLxHxK = project("query", self.num_heads, "heads")
        k_BxLxGxK = project("key", kv_heads, kv_name)
        v_BxLxGxK = project("value", kv_heads, kv_name)
        cached = self.decode and self.has_variable("cache", "cached_key")
        cache = self._cache(k_BxLxGxK, v_BxLxGxK) if self.decode else None
        offset = cache[0].value if cached and cache is not None else 0
        if self.rope_base is not None:
            q_BxLxHxK = rotary_embedding(q_BxLxHxK, self.rope_base, self.rope_scaling, offset)
            k_BxLxGxK = rotary_embedding(k_BxLxGxK, self.rope_base, self.rope_scaling, offset)
        if cached and cache is not None:  # this call's keys and values after the earlier ones
            index, keys, values = cache
            at = (0, offset, 0, 0)
            keys.value = jax.lax.dynamic_update_slice(keys.value, k_BxLxGxK, at)
            values.value = jax.lax.dynamic_update_slice(values.value, v_BxLxGxK, at)
            index.value = jnp.asarray(offset + x_BxLxD.shape[1], jnp.int32)
            k_BxLxGxK, v_BxLxGxK = keys.value, values.value
        if grouped:  # each key and value head, once per query head of its group
            group = self.num_heads // kv_heads
            k_BxLxGxK, v_BxLxGxK = (jnp.repeat(t, group, axis=2) for t in (k_BxLxGxK, v_BxLxGxK))
        k_BxLxHxK, v_BxLxHxK = k_BxLxGxK, v_BxLxGxK
        if cached:
            mixed_BxLxHxK = _attend_to_cache(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, offset)
        elif train and self.dropout_rate > 0:  # dropout on the weights: they must exist
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
            ("embed",) if self.use_bias else None,
            self.param_dtype,
            name="out",
        )(mixed_BxLxHxK)

    def _cache(self, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> tuple[Any, Any, Any]:
        """The next position, and every key and value so far (made at init as long as
        its input: the longest sequence to decode)."""
        return (
            self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32)),
            self.variable("cache", "cached_key", jnp.zeros, k_BxLxGxK.shape, k_BxLxGxK.dtype),
            self.variable("cache", "cached_value", jnp.zeros, v_BxLxGxK.shape, v_BxLxGxK.dtype),
        )


def _attend_to_cache(
    q_BxLxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array, offset: Any
) -> jax.Array:
    """Queries at positions ``offset..offset + L - 1`` attending to the cached keys at
    positions up to their own (later cache rows are not written yet)."""
    length, total = q_BxLxHxK.shape[1], k_BxTxHxK.shape[1]
    logits_BxHxLxT = jnp.einsum("bqhk,bthk->bhqt", q_BxLxHxK, k_BxTxHxK).astype(jnp.float32)
    logits_BxHxLxT = logits_BxHxLxT / math.sqrt(q_BxLxHxK.shape[-1])
    seen_LxT = jnp.arange(total)[None, :] <= offset + jnp.arange(length)[:, None]
    weights_BxHxLxT = jax.nn.softmax(jnp.where(seen_LxT, logits_BxHxLxT, -jnp.inf), axis=-1)
    return jnp.einsum("bhqt,bthk->bqhk", weights_BxHxLxT.astype(v_BxTxHxK.dtype), v_BxTxHxK)


class Mlp(nn.Module):
    """Dense to ``mlp_dim``, GELU, dense back to the model width; or, with ``kind=
    "swiglu"``, ``down(silu(gate(x)) * up(x))``."""

    mlp_dim: int
    kind: MlpKind = "gelu"
    use_bias: bool = True
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        def dense(width: int, names: tuple[str, str], name: str) -> nn.Dense:
            return nn.Dense(
                width,
                use_bias=self.use_bias,
                kernel_init=_normal(*names),
                bias_init=_zeros(names[1]),
                param_dtype=self.param_dtype,
                name=name,
            )

        up_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "up")(x_BxLxD)
        if self.kind == "swiglu":
            gate_BxLxF = dense(self.mlp_dim, ("embed", "mlp"), "gate")(x_BxLxD)
            h_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF
        else:
            h_BxLxF = nn.gelu(up_BxLxF)
        h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("batch", "length", "mlp"))
        return dense(x_BxLxD.shape[-1], ("mlp", "embed"), "down")(h_BxLxF)


class Block(nn.Module):
    """One pre-norm layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    ``train`` may be passed by position, as ``nn.remat`` needs for a static argument.
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention: AttentionImplementation = "auto"
    num_kv_heads: int | None = None
    rope_base: float | None = None
    norm: Norm = "layer"
    mlp: MlpKind = "gelu"
    use_bias: bool = True
    param_dtype: Any = jnp.float32
    rope_scaling: RopeScaling | None = None
    norm_epsilon: float | None = None
    decode: bool = False
    head_dim: int | None = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, train: bool = False) -> jax.Array:
        dropout = nn.Dropout(self.dropout_rate, deterministic=not train)
        attention = CausalSelfAttention(
            self.num_heads,
            self.dropout_rate,
            self.attention,
            self.num_kv_heads,
            self.rope_base,
            self.use_bias,
            self.param_dtype,
            self.rope_scaling,
            self.decode,
            self.head_dim,
            name="attention",
        )
        epsilon = self.norm_epsilon
        normed = _norm(self.norm, "attention_norm", self.param_dtype, epsilon)(x_BxLxD)
        x_BxLxD = x_BxLxD + dropout(attention(normed, train=train))
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
        mlp = Mlp(self.mlp_dim, self.mlp, self.use_bias, self.param_dtype, name="mlp")
        normed = _norm(self.norm, "mlp_norm", self.param_dtype, epsilon)(x_BxLxD)
        x_BxLxD = x_BxLxD + dropout(mlp(normed))
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
      num_heads: attention heads; must divide ``embed_dim`` unless ``head_dim`` is set.
      embed_dim: the model width.
      mlp_dim: the hidden width of each MLP.
      max_length: the longest input; learned position codes have this many rows.
      dropout_rate: dropout on embeddings, attention weights and block outputs, in
        training only.
      positions: ``"learned"`` (a trained ``[max_length, embed_dim]`` table),
        ``"sinusoidal"`` (fixed codes added to the embeddings, no parameters) or
        ``"rope"`` (queries and keys rotated by their position in every layer,
        ``rotary_embedding`` with ``rope_base``; no parameters).
      tie_embeddings: compute logits with the token embedding (``x @ embedding.T``)
        instead of a separate ``[embed_dim, vocab_size]`` matrix. Under FSDP the table
        is gathered once a step for both uses, and their gradients are added on each
        device before one reduction.
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
      num_kv_heads: key and value heads (grouped-query attention); must divide
        ``num_heads``. ``None``: as many as ``num_heads``.
      norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm), before each sub-layer and
        at the end.
      mlp: ``"gelu"`` or ``"swiglu"`` (three matrices: gate, up, down).
      use_bias: biases in the projections, the MLP and the output matrix.
      rope_base: the base of the rotary frequencies (``positions="rope"``).
      param_dtype: the parameters' dtype (``jnp.bfloat16`` halves their memory; the
        compute dtype is the train state's precision).
      rope_scaling: Llama 3.1's stretch of the rotary frequencies (``RopeScaling``);
        ``None``: none.
      norm_epsilon: the epsilon of every norm; ``None``: 1e-5 for RMSNorm (LLaMA's),
        1e-6 for LayerNorm.
      decode: keep every layer's keys and values in a ``"cache"`` collection and take
        the tokens that follow the cached ones (``greedy_generate``); ``init`` with the
        longest sequence to decode makes the cache. Needs ``positions="rope"``.
      head_dim: the width of each query, key and value head; ``None``: ``embed_dim //
        num_heads``. Set where the heads together are narrower or wider than the model
        (Mistral NeMo's 32 heads of 128 in a width of 5120, MaxText's scaled models).

    ``llama(...)`` builds the LLaMA family's architecture (RoPE, RMSNorm, SwiGLU,
    grouped-query attention, no biases) at the published sizes.

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
    positions: Literal["learned", "sinusoidal", "rope"] = "learned"
    tie_embeddings: bool = True
    remat: RematPolicy = "none"
    scan_layers: bool = False
    attention: AttentionImplementation = "auto"
    num_kv_heads: int | None = None
    norm: Norm = "layer"
    mlp: MlpKind = "gelu"
    use_bias: bool = True
    rope_base: float = 10000.0
    param_dtype: Any = jnp.float32
    rope_scaling: RopeScaling | None = None
    norm_epsilon: float | None = None
    decode: bool = False
    head_dim: int | None = None

    @property
    def head_width(self) -> int:
        """Each query, key and value head's width: ``head_dim``, or ``embed_dim //
        num_heads`` where it is ``None``."""
        return self.head_dim or self.embed_dim // self.num_heads

    def _check(self, tokens_BxL: jax.Array) -> None:
        remat_policy(self.remat)
        check_implementation(self.attention, where="Transformer")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"Transformer head_dim must be positive or None; got {self.head_dim}.")
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(
                f"Transformer embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; pick num_heads among the divisors of embed_dim, "
                "or set head_dim."
            )
        if self.decode and self.positions != "rope":
            raise ValueError(
                f"Transformer decode=True needs positions='rope' (each step rotates its keys "
                f"by their place in the sequence); got positions={self.positions!r}."
            )
        if self.positions not in ("learned", "sinusoidal", "rope"):
            raise ValueError(
                "Transformer positions must be 'learned', 'sinusoidal' or 'rope'; got "
                f"{self.positions!r}."
            )
        if self.num_kv_heads is not None and (
            self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"Transformer num_kv_heads={self.num_kv_heads} must divide num_heads="
                f"{self.num_heads} (each key and value head serves a group of query heads)."
            )
        for name, value, allowed in (
            ("norm", self.norm, ("layer", "rms")),
            ("mlp", self.mlp, ("gelu", "swiglu")),
        ):
            if value not in allowed:
                raise ValueError(f"Transformer {name} must be one of {allowed}; got {value!r}.")
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
            self.vocab_size,
            self.embed_dim,
            embedding_init=_normal("vocab", "embed"),
            param_dtype=self.param_dtype,
            name="embed",
        )
        # A tied table serves the lookup and the logits whole along the model width:
        # under FSDP its shards are gathered once a step, and the two uses' gradients
        # are added on each device and reduced once (models/_tied.py), where each use
        # would move its own.
        ids_BxL = jnp.clip(tokens_BxL, 0, self.vocab_size - 1)
        table_VxD = embed.embedding
        if self.tie_embeddings:
            table_VxD = tied.whole_width(table_VxD)
            x_BxLxD = tied.lookup(table_VxD, ids_BxL)
        else:
            x_BxLxD = jnp.take(table_VxD, ids_BxL, axis=0)
        # An id outside the vocabulary would read another row (-5) or NaN (vocab_size
        # and up) without a word: NaN for both, which fit stops on and names.
        known_BxL = (tokens_BxL >= 0) & (tokens_BxL < self.vocab_size)
        x_BxLxD = jnp.where(known_BxL[..., None], x_BxLxD, jnp.nan)
        if self.positions == "learned":
            table_LxD = self.param(
                "position_embedding",
                _normal(None, "embed"),
                (self.max_length, self.embed_dim),
                self.param_dtype,
            )
            x_BxLxD = x_BxLxD + table_LxD[:length].astype(x_BxLxD.dtype)
        elif self.positions == "sinusoidal":
            x_BxLxD = x_BxLxD + sinusoidal_positions(length, self.embed_dim).astype(x_BxLxD.dtype)
        x_BxLxD = nn.Dropout(self.dropout_rate, deterministic=not train)(x_BxLxD)
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
        block = remat_block(Block, self.remat, scanned=self.scan_layers)
        shape = {
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention": self.attention,
            "num_kv_heads": self.num_kv_heads,
            "rope_base": self.rope_base if self.positions == "rope" else None,
            "norm": self.norm,
            "mlp": self.mlp,
            "use_bias": self.use_bias,
            "param_dtype": self.param_dtype,
            "rope_scaling": self.rope_scaling if self.positions == "rope" else None,
            "norm_epsilon": self.norm_epsilon,
            "decode": self.decode,
            "head_dim": self.head_dim,
        }
        if self.scan_layers:
            layers = block(**shape, name="layers")
            x_BxLxD = scan_blocks(layers, x_BxLxD, train, length=self.num_layers)
        else:
            for layer in range(self.num_layers):
                x_BxLxD = block(**shape, name=f"block_{layer}")(x_BxLxD, train)
        x_BxLxD = _norm(self.norm, "final_norm", self.param_dtype, self.norm_epsilon)(x_BxLxD)
        if self.tie_embeddings:
            query_BxLxD, table_VxD = promote_dtype(x_BxLxD, table_VxD)
            logits_BxLxV = tied.logits(query_BxLxD, table_VxD)
        else:
            logits_BxLxV = nn.Dense(
                self.vocab_size,
                use_bias=self.use_bias,
                kernel_init=_normal("embed", "vocab"),
                bias_init=_zeros("vocab"),
                param_dtype=self.param_dtype,
                name="head",
            )(x_BxLxD)
        return nn.with_logical_constraint(logits_BxLxV, ("batch", "length", "vocab"))


LLAMA_SIZES: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B: 1,235,814,400 parameters (embeddings tied).
    "1b": {"num_layers": 16, "embed_dim": 2048, "num_heads": 32, "num_kv_heads": 8,
           "mlp_dim": 8192, "vocab_size": 128256, "tie_embeddings": True,
           "rope_base": 500000.0},
    # Llama 2 7B: 6,738,415,616 parameters (every head its own keys and values).
    "7b": {"num_layers": 32, "embed_dim": 4096, "num_heads": 32, "num_kv_heads": 32,
           "mlp_dim": 11008, "vocab_size": 32000, "tie_embeddings": False,
           "rope_base": 10000.0},
    # Llama 3 8B: 8,030,261,248 parameters.
    "8b": {"num_layers": 32, "embed_dim": 4096, "num_heads": 32, "num_kv_heads": 8,
           "mlp_dim": 14336, "vocab_size": 128256, "tie_embeddings": False,
           "rope_base": 500000.0},
}  # fmt: skip
"""The published shapes of three LLaMA models (their model cards' configurations)."""


def llama_architecture(size: str) -> dict[str, Any]:
    """The ``Transformer`` fields of ``llama(size)`` (all but ``max_length``), for
    ``meshkit.plan.transformer_workload(**llama_architecture("8b"), length=...)``.

    Examples:
        >>> sorted(llama_architecture("8b"))[:4]
        ['embed_dim', 'mlp', 'mlp_dim', 'norm']
    """
    if size not in LLAMA_SIZES:
        raise ValueError(f"Unknown LLaMA size {size!r}; choose one of {sorted(LLAMA_SIZES)}.")
    return {
        **LLAMA_SIZES[size],
        "positions": "rope",
        "norm": "rms",
        "mlp": "swiglu",
        "use_bias": False,
    }


def llama(size: str, **overrides: Any) -> Transformer:
    """A ``Transformer`` with the LLaMA architecture at a published size.

    RoPE, RMSNorm, SwiGLU, grouped-query attention and no biases, with the shapes of
    ``LLAMA_SIZES[size]``: ``"1b"`` (Llama 3.2 1B), ``"7b"`` (Llama 2 7B) or ``"8b"``
    (Llama 3 8B). ``overrides`` replace any field (``max_length``, ``remat``,
    ``scan_layers``, ``param_dtype=jnp.bfloat16``, or a smaller ``num_layers``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = llama("8b", max_length=8)
        >>> shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        >>> sum(x.size for x in jax.tree.leaves(shapes))  # the published count
        8030261248
    """
    return Transformer(**{**llama_architecture(size), "max_length": 4096, **overrides})
