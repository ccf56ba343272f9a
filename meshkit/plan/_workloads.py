"""Ready-made workloads: a GPT-style language model of any size."""

from __future__ import annotations

import math
from typing import Any

import flax.linen
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


def float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` keeping its state in float32 whatever the parameters' dtype: it sees float32
    copies of the parameters and gradients, and its updates are cast back to each
    parameter's dtype (bfloat16 parameters, float32 AdamW moments).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
        >>> tx = float32_state(optax.adam(0.1))
        >>> state = tx.init(params)
        >>> state[0].mu["w"].dtype, tx.update(params, state, params)[0]["w"].dtype
        (dtype('float32'), dtype(bfloat16))
    """

    def wide(tree: Any) -> Any:
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

    def init(params: Any) -> Any:
        return tx.init(wide(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        new, state = tx.update(wide(updates), state, None if params is None else wide(params))
        return jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates), state

    return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


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
    **architecture: Any,
) -> Workload:
    """A ``meshkit.models.Transformer`` trained on next-token prediction (GPT-style by
    default; ``architecture`` takes any other field of the model, such as LLaMA's:
    ``positions="rope", norm="rms", mlp="swiglu", num_kv_heads=8, use_bias=False``).

    Layers run under ``nn.scan`` by default, so compiling a deep model takes as long as
    a shallow one; a layout's ``remat`` policy goes to every block. The optimizer
    defaults to AdamW with float32 moments: with ``param_dtype=jnp.bfloat16`` the
    parameters and gradients are bfloat16 and the optimizer state stays float32 (AdamW
    on float32 copies of the gradients, its updates cast back). A GPT's parameter count
    is ``num_layers * (4 * embed_dim**2 + 2 * embed_dim * mlp_dim) + vocab_size *
    embed_dim`` plus biases, norms and ``length * embed_dim`` learned position codes.
    ``attention`` goes to the model (``"pallas"`` for a TPU target: the flash kernel
    the pod runs; ``"auto"`` picks by the backend that compiles, XLA on a CPU).

    Examples:
        >>> workload = transformer_workload(num_layers=2, embed_dim=64, num_heads=4,
        ...     mlp_dim=256, vocab_size=256, length=32, batch_size=8)
        >>> workload.batch["tokens"].shape
        (8, 33)
    """
    from meshkit.models import Transformer

    def transformer(remat: RematPolicy) -> Transformer:
        return Transformer(
            vocab_size=vocab_size,
            num_layers=num_layers,
            num_heads=num_heads,
            embed_dim=embed_dim,
            mlp_dim=mlp_dim,
            max_length=length,
            remat=remat,
            scan_layers=scan_layers,
            attention=attention,
            **architecture,
        )

    def model(remat: RematPolicy) -> Model:
        return linen_model(transformer(remat), jnp.zeros((1, length), jnp.int32))

    if tx is None:
        tx = float32_state(optax.adamw(3e-4, weight_decay=0.1))
    return Workload(
        model=model,
        tx=tx,
        loss_fn=next_token_loss,
        batch={"tokens": jax.ShapeDtypeStruct((batch_size, length + 1), jnp.int32)},
        model_flops=transformer_model_flops(
            transformer("none"), batch_size=batch_size, length=length
        ),
    )


def transformer_model_flops(module: Any, *, batch_size: int, length: int) -> float:
    """The model FLOPs of one training step of a ``Transformer``: per token, six per
    parameter a token is multiplied by (forward 2, backward 4) and twelve per layer,
    position attended and query width (heads x head width: the model width unless
    ``head_dim`` says otherwise) for attention's two products (PaLM's count, appendix B,
    no causal halving); kernels and recomputation change none of it.

    The parameters counted are every one but the input embedding's where a separate
    output matrix computes the logits (a lookup multiplies nothing) and learned
    position codes; a tied embedding counts once, as the logits' matrix.

    Examples:
        >>> from meshkit.models import Transformer
        >>> llama = Transformer(vocab_size=256, num_layers=2, num_heads=4, embed_dim=64,
        ...     mlp_dim=256, max_length=32, positions="rope", norm="rms", mlp="swiglu",
        ...     use_bias=False, tie_embeddings=False)
        >>> layer = 4 * 64 * 64 + 3 * 64 * 256 + 2 * 64  # attention, MLP, norms
        >>> n = 2 * layer + 64 * 256 + 64  # the output matrix, the final norm
        >>> attention = 12 * 2 * 32 * 64  # layers, positions, width
        >>> transformer_model_flops(llama, batch_size=8, length=32) == 8 * 32 * (6 * n + attention)
        True
        >>> wide = llama.clone(head_dim=32)  # 4 heads of 32 in a width of 64: queries 128 wide
        >>> layer = 4 * 64 * 128 + 3 * 64 * 256 + 2 * 64
        >>> n = 2 * layer + 64 * 256 + 64
        >>> transformer_model_flops(wide, batch_size=8, length=32) == 8 * 32 * (
        ...     6 * n + 12 * 2 * 32 * 128)
        True
    """
    boxed = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, length), jnp.int32))
    params = flax.linen.unbox(boxed)["params"]
    skipped = {"position_embedding"} | ({"embed"} if "head" in params else set())
    counted = sum(
        math.prod(leaf.shape)
        for name, tree in params.items()
        if name not in skipped
        for leaf in jax.tree.leaves(tree)
    )
    query_width = module.num_heads * module.head_width
    per_token = 6 * counted + 12 * module.num_layers * length * query_width
    return float(batch_size * length * per_token)


def korthikanti_activation_bytes(
    *,
    length: int,
    batch: int,
    width: int,
    heads: int,
    softmax_bytes: int = 2,
    fused_attention: bool = False,
) -> float:
    """Activation bytes one Transformer layer keeps for its backward pass, 16-bit
    activations, by the count of Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", section 4.1) without dropout (meshkit's
    models train without it by default). Their ``s·b·h·(34 + 5·a·s/h)`` holds, besides
    the block's two dropout masks (``2·s·b·h``), three ``[s, s]`` tensors per head: the
    softmax (``2·a·s²·b``), its dropout mask (``a·s²·b``) and the dropout's output
    (``2·a·s²·b``), which the product with V keeps. Without dropout that product keeps
    the softmax itself: ``s·b·h·32 + softmax_bytes·a·s²·b``, with ``softmax_bytes`` 2
    for a 16-bit softmax and 4 for a float32 one (JAX's XLA attention computes it in
    float32); a fused attention kernel keeps no ``[s, s]`` tensor: ``32·s·b·h``.

    Examples:
        >>> shape = dict(length=2048, batch=1, width=1024, heads=8)
        >>> korthikanti_activation_bytes(**shape) / 2**20  # a 16-bit softmax
        128.0
        >>> korthikanti_activation_bytes(**shape, softmax_bytes=4) / 2**20  # XLA attention
        192.0
    """
    s, b, h, a = length, batch, width, heads
    attention = 0 if fused_attention else softmax_bytes * a * s / h
    return s * b * h * (32 + attention)
