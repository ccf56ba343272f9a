"""Ready-made workloads: a GPT-style language model of any size."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshkit._types import Batch
from meshkit.models._attention import AttentionImplementation
from meshkit.models._remat import RematPolicy
from meshkit.plan._measure import Workload
from meshkit.train._gradients import LossOutput
from meshkit.train._state import Model, TrainState, linen_model
from meshkit.train._step import apply_model


def next_token_loss(
    params: Any, state: TrainState, batch: Batch, rng: jax.Array
) -> tuple[jax.Array, LossOutput]:
    """Mean cross-entropy of each next token of ``batch["tokens"]`` (``[B, L + 1]``)."""
    tokens_BxL1 = batch["tokens"]
    logits_BxLxV, collections = apply_model(state, tokens_BxL1[:, :-1], params=params, rng=rng)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, tokens_BxL1[:, 1:])
    return loss.mean(), LossOutput(collections=collections, metrics={})


def transformer_workload(
    *,
    num_layers: int,
    embed_dim: int,
    num_heads: int,
    mlp_dim: int,
    vocab_size: int,
    length: int,
    batch_size: int,
    tx: optax.GradientTransformation | None = None,
    scan_layers: bool = True,
    attention: AttentionImplementation = "auto",
) -> Workload:
    """A GPT-style ``meshkit.models.Transformer`` trained on next-token prediction.

    Layers run under ``nn.scan`` by default, so compiling a deep model takes as long as
    a shallow one; a layout's ``remat`` policy goes to every block. The optimizer
    defaults to AdamW (two float32 moments per parameter). Its parameter count is
    ``num_layers * (4 * embed_dim**2 + 2 * embed_dim * mlp_dim) + vocab_size * embed_dim``
    plus biases, norms and ``length * embed_dim`` learned position codes. ``attention``
    goes to the model (``"pallas"`` for a TPU target: the flash kernel the pod runs;
    ``"auto"`` picks by the backend that compiles, XLA on a CPU).

    Examples:
        >>> workload = transformer_workload(num_layers=2, embed_dim=64, num_heads=4,
        ...     mlp_dim=256, vocab_size=256, length=32, batch_size=8)
        >>> workload.batch["tokens"].shape
        (8, 33)
    """
    from meshkit.models import Transformer

    def model(remat: RematPolicy) -> Model:
        module = Transformer(
            vocab_size=vocab_size,
            num_layers=num_layers,
            num_heads=num_heads,
            embed_dim=embed_dim,
            mlp_dim=mlp_dim,
            max_length=length,
            remat=remat,
            scan_layers=scan_layers,
            attention=attention,
        )
        return linen_model(module, jnp.zeros((1, length), jnp.int32))

    return Workload(
        model=model,
        tx=tx if tx is not None else optax.adamw(3e-4, weight_decay=0.1),
        loss_fn=next_token_loss,
        batch={"tokens": jax.ShapeDtypeStruct((batch_size, length + 1), jnp.int32)},
    )
