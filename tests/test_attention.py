"""Attention through one function: the XLA path (and the models that use it) against
the reference computation, outputs and gradients; masks; the refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshkit.models import Transformer, ViT, dot_product_attention

pytestmark = pytest.mark.once  # one device's arithmetic


def reference(q, k, v, *, causal: bool, key_mask=None):
    """The textbook computation: float32 logits, masked, softmax, weighted values."""
    logits = jnp.einsum("bqhk,bthk->bhqt", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    allowed = jnp.ones(logits.shape[-2:], bool)
    if causal:
        allowed = jnp.tril(allowed)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqt,bthk->bqhk", weights.astype(q.dtype), v)


def qkv(length: int = 24, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (2, length, 4, 16), dtype) for key in keys]


@pytest.mark.parametrize("causal", [True, False])
def test_the_xla_path_gives_the_reference_outputs_and_gradients(causal: bool):
    q, k, v = qkv()

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))

    ours = jax.value_and_grad(
        lambda *a: loss(
            lambda q, k, v: dot_product_attention(q, k, v, causal=causal, implementation="xla"),
            *a,
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    ref = jax.value_and_grad(
        lambda *a: loss(lambda q, k, v: reference(q, k, v, causal=causal), *a), argnums=(0, 1, 2)
    )(q, k, v)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for got, want in zip(ours[1], ref[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_key_padding_mask_hides_the_padded_keys():
    q, k, v = qkv()
    lengths = jnp.array([24, 10])
    mask = jnp.arange(24)[None, :] < lengths[:, None]
    out = dot_product_attention(q, k, v, causal=True, key_mask_BxT=mask, implementation="xla")
    np.testing.assert_allclose(
        out, reference(q, k, v, causal=True, key_mask=mask), rtol=1e-5, atol=1e-6
    )
    garbage = v.at[1, 10:].set(1e6)  # what padding holds must not matter
    again = dot_product_attention(
        q, k, garbage, causal=True, key_mask_BxT=mask, implementation="xla"
    )
    np.testing.assert_array_equal(out[1], again[1])


def test_the_transformer_and_vit_give_the_same_logits_with_every_cpu_implementation():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    images = jax.random.normal(jax.random.key(2), (2, 8, 8, 3))
    for make, x in (
        (lambda a: Transformer(num_layers=1, num_heads=2, embed_dim=32, mlp_dim=64,
                               max_length=16, attention=a), tokens),
        (lambda a: ViT(num_classes=10, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                       mlp_dim=32, attention=a), images),
    ):  # fmt: skip
        variables = make("auto").init(jax.random.key(0), x)
        variables = jax.tree_util.tree_map_with_path(  # ViT's head starts at zero: ones
            lambda path, x: jnp.ones_like(x) if "head" in jax.tree_util.keystr(path) else x,
            variables,
        )
        auto, xla = (make(a).apply(variables, x) for a in ("auto", "xla"))
        np.testing.assert_array_equal(auto, xla)
        assert np.abs(np.asarray(auto)).max() > 0


def test_fused_kernels_are_refused_where_they_cannot_run():
    q, k, v = qkv(length=8)
    if jax.devices()[0].platform != "gpu":
        with pytest.raises(ValueError, match="attention='cudnn' needs an NVIDIA GPU"):
            dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="must be one of"):
        dot_product_attention(q, k, v, implementation="flash")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="no key padding mask"):
        dot_product_attention(q, k, v, key_mask_BxT=jnp.ones((2, 8), bool), implementation="pallas")
    model = Transformer(num_layers=1, num_heads=2, embed_dim=16, mlp_dim=32, max_length=8,
                        dropout_rate=0.1, attention="cudnn")  # fmt: skip
    tokens = jnp.zeros((2, 8), jnp.int32)
    variables = model.clone(attention="auto").init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="has no dropout on the attention weights"):
        model.apply(variables, tokens, train=True, rngs={"dropout": jax.random.key(1)})
    with pytest.raises(ValueError, match="Transformer attention must be one of"):
        Transformer(attention="fast").init(jax.random.key(0), tokens)  # pyright: ignore[reportArgumentType]
