"""The objective: the exact mean of per-example losses over the real rows, plus L2."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshkit.lbfgs._data import Dataset

PerExampleLoss = Callable[[Any, Any], jax.Array]
"""``loss_fn(params, batch) -> losses[rows]``: one loss per example, not their mean.

Not ``meshkit.train.LossFn``, which returns the mean loss and metrics of a training batch.
"""

L2Mask = Callable[[str, Any], bool]
"""``l2_mask(path, leaf) -> bool``: whether the leaf at ``path`` (``"['b']"``) is penalised."""

ValueAndGrad = Callable[[Any], tuple[jax.Array, Any]]

_PATH_KEY = re.compile(r"\[['\"]([^'\"]*)['\"]\]|\.(\w+)|\[(\d+)\]")


@dataclasses.dataclass(frozen=True)
class l2_except:  # noqa: N801 - used like a function: l2_mask=l2_except("b")
    """An ``l2_mask`` that penalises every leaf except those whose path names one of ``names``.

    A leaf is excluded when one of its path keys equals a name, e.g. ``"b"`` excludes
    ``params["b"]`` (an intercept) and ``params["dense"]["b"]``. Equal masks compare
    equal, so solvers built with them share compiled programs.

    Examples:
        >>> mask = l2_except("b")
        >>> mask("['w']", None), mask("['b']", None), mask("['dense'].b", None)
        (True, False, False)
    """

    names: tuple[str, ...]

    def __init__(self, *names: str):
        if not names or not all(isinstance(name, str) for name in names):
            raise TypeError(
                f"l2_except takes the leaf names to leave unpenalised, e.g. l2_except('b'); "
                f"got {names!r}."
            )
        object.__setattr__(self, "names", tuple(names))

    def __call__(self, path: str, leaf: Any) -> bool:
        # keystr paths: ['key'] for dict keys, .name for attributes, [0] for sequences
        keys = {next(filter(None, match)) for match in _PATH_KEY.findall(path)}
        return not keys & set(self.names)


def l2_leaf_mask(params: Any, l2_mask: L2Mask | None) -> Any:
    """A pytree of Python bools: which leaves of ``params`` the L2 term penalises."""
    if l2_mask is None:
        return jax.tree.map(lambda _: True, params)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: bool(l2_mask(jax.tree_util.keystr(path), leaf)), params
    )


def make_objective(
    loss_fn: PerExampleLoss,
    data: Dataset,
    l2: jax.Array,
    l2_mask: L2Mask | None,
    *,
    gradient_blocks: int = 1,
) -> ValueAndGrad:
    """``params -> (value, grad)`` of ``mean(loss over real rows) + l2 / 2 * ||params||²``.

    The mean divides a ``where``-masked sum by the number of real rows, so padded rows
    contribute exactly nothing (a nan there cannot leak into the value). Inside a jit
    with the data sharded over the data axis, the sum is an all-reduce: every device
    ends with the same value and gradient.

    With ``gradient_blocks > 1`` (it must divide the row count), the rows are split into
    that many blocks and the gradient is the sum of one gradient per block: for a
    linear layer the backward product ``Xᵀ R`` becomes a batched matrix product over
    row blocks, which a GPU runs at its memory bandwidth where the one long
    reduction does not. Same value and gradient up to summation order.
    """
    count = jnp.sum(data.mask, dtype=jnp.int32)

    def data_sum(params: Any, batch: Any, mask: jax.Array) -> jax.Array:
        losses = loss_fn(params, batch)
        accumulate = jnp.promote_types(losses.dtype, jnp.float32)  # never sum in bf16
        return jnp.sum(jnp.where(mask, losses, 0), dtype=accumulate)

    def penalty(params: Any) -> jax.Array:
        penalised = [
            leaf
            for leaf, keep in zip(
                jax.tree.leaves(params),
                jax.tree.leaves(l2_leaf_mask(params, l2_mask)),
                strict=True,
            )
            if keep
        ]
        return 0.5 * l2 * optax.tree.norm(penalised, squared=True)

    if gradient_blocks == 1:

        def objective(params: Any) -> jax.Array:
            mean = data_sum(params, data.batch, data.mask) / count
            return mean + penalty(params).astype(mean.dtype)

        return jax.value_and_grad(objective)

    def blocked(leaf: jax.Array) -> jax.Array:
        return leaf.reshape(gradient_blocks, leaf.shape[0] // gradient_blocks, *leaf.shape[1:])

    batch, mask = jax.tree.map(blocked, data.batch), blocked(data.mask)

    def value_and_grad(params: Any) -> tuple[jax.Array, Any]:
        per_block = jax.vmap(jax.value_and_grad(data_sum), in_axes=(None, 0, 0))
        sums, grads = per_block(params, batch, mask)
        mean = jnp.sum(sums) / count
        extra, extra_grad = jax.value_and_grad(penalty)(params)
        grad = jax.tree.map(
            lambda g, e: (jnp.sum(g, axis=0) / count + e).astype(e.dtype), grads, extra_grad
        )
        return mean + extra.astype(mean.dtype), grad

    return value_and_grad


def gradient_blocks_for(
    *, platform: str, rows_per_device: int, param_count: int, limit: int | None
) -> int:
    """How many row blocks per device the objective uses (``1``: one long reduction).

    ``limit`` caps the count (``None``: the backend's choice — ``1`` on CPUs, where XLA's
    plain product is as fast or faster, and up to 256 on GPUs and TPUs). The count is
    the largest divisor of ``rows_per_device`` within the cap whose per-block gradients
    (``count × param_count`` values) stay under 16M values.
    """
    cap = (1 if platform == "cpu" else 256) if limit is None else limit
    cap = max(1, min(cap, rows_per_device, (1 << 24) // max(param_count, 1)))
    return next(d for d in range(cap, 0, -1) if rows_per_device % d == 0)


def multiclass_logreg(params: Any, batch: Any) -> jax.Array:
    """Per-example softmax cross-entropy of a linear model, unaveraged: the JAXopt
    notebook's objective.

    Args:
      params: a weight matrix ``w[F, K]``, or ``{"w": w[F, K], "b": b[K]}`` with an
        intercept.
      batch: ``{"x": x[n, F], "y": y[n]}`` with integer labels in ``[0, K)``.

    Returns:
      ``losses[n] = logsumexp(x @ w + b) - (x @ w + b)[y]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.array([0, 1])}
        >>> [round(loss, 4) for loss in multiclass_logreg(jnp.zeros((3, 4)), batch).tolist()]
        [1.3863, 1.3863]
    """
    if isinstance(params, dict):
        logits = batch["x"] @ params["w"] + params["b"]
    else:
        logits = batch["x"] @ params
    picked = jnp.take_along_axis(logits, batch["y"][:, None].astype(jnp.int32), axis=1)[:, 0]
    return jax.nn.logsumexp(logits, axis=1) - picked


def linear_params(
    num_features: int, num_classes: int, *, intercept: bool = False, dtype: Any = np.float32
) -> Any:
    """Zero parameters for ``multiclass_logreg``: ``w`` alone, or ``{"w", "b"}``.

    Examples:
        >>> linear_params(784, 10).shape
        (784, 10)
        >>> sorted(linear_params(784, 10, intercept=True))
        ['b', 'w']
    """
    w = np.zeros((num_features, num_classes), dtype)
    return {"w": w, "b": np.zeros((num_classes,), dtype)} if intercept else w
