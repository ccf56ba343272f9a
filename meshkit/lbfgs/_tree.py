"""Vector arithmetic on parameter pytrees (every reduction yields one replicated scalar)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def tree_vdot(a: Any, b: Any) -> jax.Array:
    """The inner product of two pytrees with the same structure, as one scalar."""
    dots = [jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return sum(dots[1:], start=dots[0]) if dots else jnp.zeros(())


def tree_sum_squares(tree: Any) -> jax.Array:
    """The sum of squares of every element of ``tree``; ``0.0`` for an empty tree."""
    return tree_vdot(tree, tree)


def tree_norm(tree: Any) -> jax.Array:
    """The Euclidean norm of all elements of ``tree`` together."""
    return jnp.sqrt(tree_sum_squares(tree))


def tree_axpy(alpha: jax.Array | float, x: Any, y: Any) -> Any:
    """``alpha * x + y`` leaf by leaf, in the dtype of ``y``."""
    return jax.tree.map(lambda a, b: (alpha * a + b).astype(b.dtype), x, y)


def tree_scale(alpha: jax.Array | float, x: Any) -> Any:
    """``alpha * x`` leaf by leaf, keeping each leaf's dtype."""
    return jax.tree.map(lambda a: (alpha * a).astype(a.dtype), x)
