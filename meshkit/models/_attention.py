"""Attention through one function: cuDNN's fused kernel on GPUs, a Pallas flash kernel
on TPUs, XLA elsewhere.

A plain implementation materialises a ``[batch, heads, length, length]`` matrix of
weights per layer (and keeps it for the backward pass), which is what pod users do not
run: on GPUs ``jax.nn.dot_product_attention`` calls cuDNN's fused attention, on TPUs
the Pallas flash-attention kernel computes the same result block by block without
storing the matrix. ``dot_product_attention`` chooses among them
(``implementation``), with a causal mask and a key padding mask, on ``[batch, length,
heads, head_dim]`` arrays as the models hold them.

The Pallas kernel runs per device under ``shard_map`` over the mesh axes the batch and
heads are split over (from the logical rules in force: ``batch`` and ``heads``); the
length and head dimensions must be whole on each device.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, cast, get_args

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

AttentionImplementation = Literal["auto", "xla", "cudnn", "pallas"]
"""How attention is computed: ``"auto"`` (cuDNN on a GPU for 16-bit inputs, Pallas on a
TPU, XLA elsewhere), ``"xla"``, ``"cudnn"`` or ``"pallas"``."""

IMPLEMENTATIONS: tuple[str, ...] = get_args(AttentionImplementation)


def check_implementation(implementation: object, *, where: str) -> None:
    """Raises a ``ValueError`` naming ``where`` unless ``implementation`` is known."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{where} attention must be one of {list(IMPLEMENTATIONS)}, got {implementation!r}."
        )


def check_weights_kept(implementation: str, *, where: str) -> None:
    """Raises unless ``implementation`` computes the attention weights (needed for
    dropout on them): fused kernels never hold them."""
    if implementation in ("cudnn", "pallas"):
        raise ValueError(
            f"{where}(attention={implementation!r}) has no dropout on the attention weights "
            "(the fused kernel never holds them), but the model drops them out in training. "
            "Set the attention dropout rate to 0, or use attention='auto' or 'xla'."
        )


def flax_attention_fn(implementation: AttentionImplementation) -> Any:
    """``nn.MultiHeadDotProductAttention(attention_fn=...)`` through
    ``dot_product_attention``; with a bias, a mask or dropout active, Flax's own
    function (which holds the weights)."""

    def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array, *args: Any, **kw: Any):
        bias = kw.get("bias", args[0] if args else None)
        mask = kw.get("mask", args[1] if len(args) > 1 else None)
        dropping = kw.get("dropout_rate", 0.0) > 0 and not kw.get("deterministic", True)
        if bias is not None or mask is not None or dropping:
            if dropping:
                check_weights_kept(implementation, where="ViT")
            return nn.dot_product_attention(query, key, value, *args, **kw)
        out = dot_product_attention(query, key, value, implementation=implementation)
        return out.astype(kw.get("dtype") or query.dtype)

    return attention_fn


def resolve(implementation: AttentionImplementation, dtype: Any) -> str:
    """The implementation ``"auto"`` stands for on this backend, for inputs of ``dtype``.

    Examples:
        >>> resolve("auto", jnp.float32), resolve("xla", jnp.bfloat16)  # on a CPU
        ('xla', 'xla')
    """
    if implementation != "auto":
        return implementation
    platform = jax.devices()[0].platform
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    if platform == "tpu":
        return "pallas"
    return "xla"


def dot_product_attention(
    query_BxLxHxK: jax.Array,
    key_BxTxHxK: jax.Array,
    value_BxTxHxK: jax.Array,
    *,
    causal: bool = False,
    key_mask_BxT: jax.Array | None = None,
    implementation: AttentionImplementation = "auto",
) -> jax.Array:
    """``softmax(q k^T / sqrt(K)) v`` per head: ``[B, L, H, K]`` from queries ``[B, L, H,
    K]`` and keys and values ``[B, T, H, K]``.

    Args:
      causal: position ``l`` attends to positions ``<= l`` only.
      key_mask_BxT: ``True`` for the keys to attend to (padding ``False``); not with
        ``"pallas"``.
      implementation: see ``AttentionImplementation``.

    Raises:
      ValueError: an unknown implementation, ``"cudnn"`` off an NVIDIA GPU, or a key
        mask with ``"pallas"``.

    Examples:
        >>> q = jnp.ones((2, 5, 4, 8))
        >>> dot_product_attention(q, q, q, causal=True, implementation="xla").shape
        (2, 5, 4, 8)
    """
    check_implementation(implementation, where="dot_product_attention")
    chosen = resolve(implementation, query_BxLxHxK.dtype)
    if chosen == "pallas":
        if key_mask_BxT is not None:
            raise ValueError(
                "attention='pallas' takes no key padding mask here; use attention='xla' (or "
                "'auto' off TPUs) for padded sequences."
            )
        return _pallas_flash(query_BxLxHxK, key_BxTxHxK, value_BxTxHxK, causal=causal)
    if chosen == "cudnn" and jax.devices()[0].platform != "gpu":
        raise ValueError(
            f"attention='cudnn' needs an NVIDIA GPU; this backend is "
            f"{jax.devices()[0].platform}. Use attention='auto' (cuDNN where there is one)."
        )
    mask = None if key_mask_BxT is None else key_mask_BxT[:, None, None, :]
    return jax.nn.dot_product_attention(
        query_BxLxHxK,
        key_BxTxHxK,
        value_BxTxHxK,
        mask=mask,
        is_causal=causal,
        implementation=cast(Literal["xla", "cudnn"], chosen),
    )


def _pallas_flash(
    query_BxLxHxK: jax.Array, key_BxTxHxK: jax.Array, value_BxTxHxK: jax.Array, *, causal: bool
) -> jax.Array:
    """The Pallas TPU flash kernel on ``[B, H, L, K]`` blocks, per device under
    ``shard_map`` when a mesh and logical rules are in force."""
    from jax.experimental.pallas.ops.tpu import flash_attention

    scale = 1.0 / math.sqrt(query_BxLxHxK.shape[-1])
    kernel = functools.partial(flash_attention.flash_attention, causal=causal, sm_scale=scale)

    def heads_first(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x, 1, 2)

    q, k, v = (heads_first(x) for x in (query_BxLxHxK, key_BxTxHxK, value_BxTxHxK))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return heads_first(kernel(q, k, v))
    axes = nn.logical_to_mesh_axes(("batch", "heads", "length", "kv")) or (None,) * 4
    spec = PartitionSpec(axes[0], axes[1], None, None)  # length and head_dim whole
    sharded = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )
    return heads_first(sharded(q, k, v))
