"""Pytree paths, signatures (structure, shapes, dtypes), and the leading (row) dimension."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


def path_str(path: Iterable[Any]) -> str:
    """Joins a pytree key path with ``/``: ``params/Dense_0/kernel``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


Signature = tuple[Any, ...]
"""A pytree's structure with each leaf's shape and dtype: hashable, read without a device copy."""


def signature(tree: Any) -> Signature:
    """The structure, shapes and dtypes of ``tree``, e.g. as a cache key.

    Examples:
        >>> import numpy as np
        >>> treedef, leaf = signature({"w": np.zeros((2, 3), np.float32)})
        >>> leaf
        ((2, 3), 'float32')
    """
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *((np.shape(leaf), _dtype_name(leaf)) for leaf in leaves))


def abstract(signature: Signature) -> Any:
    """The ``jax.ShapeDtypeStruct`` pytree a ``signature`` describes."""
    treedef, *leaves = signature
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*leaf) for leaf in leaves])


def _dtype_name(leaf: Any) -> str:
    try:
        return str(leaf_dtype(leaf))
    except TypeError:  # a leaf numpy cannot type: its class still keys a cache
        return type(leaf).__name__


def leaf_dtype(leaf: Any) -> np.dtype:
    """A leaf's dtype: its ``dtype`` (no device copy for a ``jax.Array``), else numpy's."""
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def leading_rows(tree: Any, *, what: str, fix: str = "") -> int:
    """The leading (row) dimension that every leaf of ``tree`` shares.

    Args:
      tree: a pytree of arrays, one row per example along the first dimension.
      what: who is asking, for the message (``"shard_batch"``).
      fix: a sentence appended to the message on a mismatch, saying what to change.

    Raises:
      ValueError: ``tree`` has no leaves, a leaf is a scalar, or the leaves disagree
        on their number of rows (the message lists every leaf's path and rows).

    Examples:
        >>> import numpy as np
        >>> leading_rows({"x": np.zeros((4, 2)), "y": np.zeros(4)}, what="example")
        4
    """
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(tree)]
    if shapes and all(shapes) and len({shape[0] for shape in shapes}) == 1:
        return int(shapes[0][0])
    if not shapes:
        raise ValueError(f"{what} got an empty pytree; pass at least one array.")
    rows = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"{what}: leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a "
                "leading row dimension (one row per example)."
            )
        rows[jax.tree_util.keystr(path)] = shape[0]
    raise ValueError(
        f"{what}: the leaves have different numbers of rows: {rows}. Every leaf needs the "
        f"same leading dimension (one row per example).{f' {fix}' if fix else ''}"
    )
