"""Rematerialisation and scanned layers for the residual blocks of meshkit's models.

A block is a linen module called as ``block(x, train)`` that returns an array of
the shape of ``x``. ``remat_block`` wraps its class in ``nn.remat`` with a named
``jax.checkpoint_policies`` policy; ``scan_blocks`` runs one instance ``length``
times as a single ``nn.scan`` over a stacked copy of its parameters, so the traced
program, and the compile time, do not grow with depth.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import flax.linen as nn
import jax

RematPolicy = Literal[
    "none",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
    "offload_dots",
]
"""What a rematerialised block keeps from its forward pass for the backward pass.

Each name is that of a ``jax.checkpoint_policies`` policy:

- ``"none"``: no rematerialisation; every intermediate the backward pass needs is kept.
- ``"dots_saveable"``: keep the results of matrix multiplications (``dot_general``),
  recompute the cheap elementwise operations between them.
- ``"dots_with_no_batch_dims_saveable"``: keep only the results of the multiplications
  with no batch dimension (the projections against weights), recompute the attention
  logits and the rest.
- ``"nothing_saveable"``: keep nothing but the block's inputs; recompute the whole
  forward pass of the block in the backward pass (the least memory, the most compute).
- ``"offload_dots"``: as ``"dots_with_no_batch_dims_saveable"``, with the kept values
  moved to pinned host memory and back
  (``offload_dot_with_no_batch_dims("device", "pinned_host")``); GPU and TPU only.
"""

REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)

LAYERS = "layers"
"""The logical name of the leading, stacked dimension of a scanned block's parameters."""

_OFFLOAD_PLATFORMS = ("gpu", "tpu")  # where jax lowers a transfer to another memory kind

Policy = Callable[..., bool]
M = TypeVar("M", bound=nn.Module)


def _offload_dots() -> Policy:
    platform = jax.default_backend()
    kinds = sorted({memory.kind for memory in jax.devices()[0].addressable_memories()})
    if platform not in _OFFLOAD_PLATFORMS:
        why = (
            f"on the {platform!r} backend jax compiles a move between memory kinds to "
            f"nothing (it moves arrays only on {' and '.join(_OFFLOAD_PLATFORMS)})"
        )
    elif "pinned_host" not in kinds:
        why = f"the {platform!r} devices have no pinned_host memory (only {kinds})"
    else:
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(
        f"remat='offload_dots' moves saved values to pinned host memory, but {why}. Use "
        "'dots_with_no_batch_dims_saveable' to keep the same values in device memory, or "
        "'nothing_saveable' to keep none."
    )


def remat_policy(name: RematPolicy) -> Policy | None:
    """The ``jax.checkpoint`` policy named ``name``; ``None`` for ``"none"`` (no remat).

    Raises:
      ValueError: ``name`` is not a ``RematPolicy``, or is ``"offload_dots"`` on a
        backend whose compiled programs cannot move arrays to pinned host memory
        (XLA:CPU among them).

    Examples:
        >>> import jax
        >>> remat_policy("nothing_saveable") is jax.checkpoint_policies.nothing_saveable
        True
        >>> remat_policy("none") is None
        True
    """
    policies = jax.checkpoint_policies
    table: dict[str, Callable[[], Policy | None]] = {
        "none": lambda: None,
        "dots_saveable": lambda: policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": lambda: policies.dots_with_no_batch_dims_saveable,
        "nothing_saveable": lambda: policies.nothing_saveable,
        "offload_dots": _offload_dots,
    }
    if name not in table:
        raise ValueError(
            f"Unknown remat policy {name!r}; expected one of {list(REMAT_POLICIES)} "
            "(names of jax.checkpoint_policies; 'none' turns rematerialisation off)."
        )
    return table[name]()


def remat_block(block: type[M], remat: RematPolicy, *, scanned: bool) -> type[M]:
    """``block`` wrapped in ``nn.remat`` with the policy ``remat``; ``block`` itself for ``"none"``.

    The block is called as ``block(x, train)``; ``train`` is static (Python control flow
    such as ``deterministic=not train`` or batch norm's ``use_running_average`` needs
    its value), so it must be passed by position. ``jax.checkpoint`` stops XLA from
    merging the recomputation with the forward pass (``prevent_cse``); a scan already
    keeps its iterations apart, so a scanned block goes without (the advice of
    ``nn.remat``'s docstring, and what MaxText does).

    Examples:
        >>> import flax.linen as nn
        >>> remat_block(nn.Dense, "none", scanned=False) is nn.Dense
        True
    """
    policy = remat_policy(remat)
    if remat == "none":
        return block
    # nn.remat counts `self` as argument 0: (self, x, train). It has no static_argnames.
    return nn.remat(block, policy=policy, prevent_cse=not scanned, static_argnums=(2,))


def _step(block: nn.Module, x: jax.Array, train: bool) -> tuple[jax.Array, None]:
    return block(x, train), None


def scan_blocks(block: nn.Module, x: jax.Array, train: bool, *, length: int) -> jax.Array:
    """``x`` through ``length`` copies of ``block``, as one ``nn.scan``.

    Each parameter of ``block`` gets a leading dimension of size ``length`` (iteration
    ``i`` uses slice ``i``), named ``"layers"`` where the parameter carries logical
    names; values sown into ``intermediates`` are stacked alike. Parameter
    initialisation and dropout draw a different key in each iteration. Call it inside
    a compact method, with ``block`` made there (its name names the stack).

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> class Residual(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x, train=False):
        ...         return x + nn.Dense(x.shape[-1])(x)
        >>> class Deep(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return scan_blocks(Residual(name="layers"), x, False, length=6)
        >>> variables = Deep().init(jax.random.key(0), jnp.ones((2, 4)))
        >>> variables["params"]["layers"]["Dense_0"]["kernel"].shape
        (6, 4, 4)
    """
    scan: Any = nn.scan(
        _step,
        variable_axes={"params": 0, "intermediates": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        # `train`: the same Python bool in every iteration (flax annotates in_axes as int)
        in_axes=nn.broadcast,  # pyright: ignore[reportArgumentType]
        length=length,
        metadata_params={nn.PARTITION_NAME: LAYERS},
    )
    y, _ = scan(block, x, train)
    return y
