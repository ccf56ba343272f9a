"""Greedy decoding with a key/value cache: a look at what a language model learned."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._logical import ActivationRules
from meshkit._rules import PartitionRules
from meshkit.models._transformer import Transformer


def greedy_generate(
    model: Transformer,
    params: Any,
    prompt: Any,
    new_tokens: int,
    *,
    rules: PartitionRules | None = None,
) -> jax.Array:
    """The ``new_tokens`` most likely tokens after each prompt, chosen one at a time.

    ``prompt`` is ``int32[batch, length]`` (every row as long: pad on the left if they
    differ). The prompt runs once through the model, filling each layer's key/value
    cache (``Transformer(decode=True)``); then each new token runs alone, attending to
    the cache, and the most likely next token (argmax, no sampling) is appended. All
    of it is one compiled program. ``params`` may be sharded (a train state's, or
    ``load_hf_params``'s); with ``rules``, the model's activation constraints resolve
    through their logical table on the parameters' mesh, so the batch splits over the
    axis of ``"batch"`` and the heads over that of ``"heads"``, as in training.

    Returns ``int32[batch, new_tokens]``. It equals transformers'
    ``generate(do_sample=False)`` on the same checkpoint (tested).

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from meshkit.models import llama
        >>> model = llama("8b", num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2,
        ...               mlp_dim=64, vocab_size=64, max_length=16)
        >>> params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))
        >>> greedy_generate(model, params["params"], jnp.ones((2, 3), jnp.int32), 5).shape
        (2, 5)
    """
    prompt_BxP = jnp.asarray(prompt, jnp.int32)
    batch, length = prompt_BxP.shape
    if new_tokens < 1 or length < 1 or length + new_tokens > model.max_length:
        raise ValueError(
            f"greedy_generate got a prompt of {length} tokens and new_tokens={new_tokens}: "
            f"both must be at least 1, and together at most the model's max_length "
            f"{model.max_length}."
        )
    decoder = model.clone(decode=True, remat="none", dropout_rate=0.0)
    total_BxT = jnp.zeros((batch, length + new_tokens), jnp.int32)
    cache_shapes = jax.eval_shape(decoder.init, jax.random.key(0), total_BxT)["cache"]

    def next_token(params: Any, cache: Any, tokens_BxL: jax.Array) -> tuple[jax.Array, Any]:
        logits_BxLxV, updated = decoder.apply(
            {"params": params, "cache": cache}, tokens_BxL, mutable=["cache"]
        )
        return jnp.argmax(logits_BxLxV[:, -1], axis=-1).astype(jnp.int32), updated["cache"]

    def generate(params: Any, prompt_BxP: jax.Array) -> jax.Array:
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)
        first_B, cache = next_token(params, cache, prompt_BxP)

        def step(carry: tuple[Any, jax.Array], _: Any) -> tuple[tuple[Any, jax.Array], jax.Array]:
            cache, token_B = carry
            following_B, cache = next_token(params, cache, token_B[:, None])
            return (cache, following_B), token_B

        (_, last_B), tokens_NxB = jax.lax.scan(step, (cache, first_B), None, new_tokens - 1)
        return jnp.concatenate([tokens_NxB.T, last_B[:, None]], axis=1)

    scope = contextlib.nullcontext()
    if rules is not None and rules.logical is not None:
        mesh = jax.tree.leaves(params)[0].sharding.mesh
        scope = ActivationRules(rules.logical, mesh).scope()
    with scope:
        return jax.jit(generate)(params, prompt_BxP)
