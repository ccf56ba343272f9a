"""A full dataset padded to the mesh and sharded over the data axis, with a mask of real rows."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dataset:
    """All rows of a full-batch problem, padded to the mesh and sharded over its data axis.

    Build it with ``shard_dataset`` or ``classification_data``. When you build one
    yourself, fill the padded rows with ordinary values (e.g. copies of real rows):
    the mask keeps a nan computed there out of the value, but a nan *input* would
    still reach the gradient through the backward pass (``0 * nan`` is nan).

    Attributes:
      batch: a pytree of global ``jax.Array``s, every leaf with ``padded_rows`` rows,
        split over the data axis (``PartitionSpec(data_axis)``).
      mask: ``bool[padded_rows]``, ``True`` on the real rows; same sharding.
      num_examples: the number of real rows (static: part of the compiled program's
        signature, like a shape).
    """

    batch: Any
    mask: jax.Array
    num_examples: int = dataclasses.field(metadata={"static": True})

    @property
    def padded_rows(self) -> int:
        """Rows including the padding: a multiple of the data axis size."""
        return int(self.mask.shape[0])


def check_data_axis(mesh: Any, data_axis: str, *, where: str) -> Mesh:
    """Raises a clear error unless ``mesh`` is a ``Mesh`` with an axis ``data_axis``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where} needs a jax.sharding.Mesh, got {type(mesh).__name__}: {mesh!r}. Build "
            "one with meshkit.make_mesh('data=-1')."
        )
    if data_axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: the mesh has axes {dict(mesh.shape)} but no {data_axis!r} axis to "
            f"split the rows over. Build the mesh with one, e.g. "
            f"meshkit.make_mesh('{data_axis}=-1'), or pass data_axis=<one of "
            f"{list(mesh.axis_names)}>."
        )
    return mesh


def _host_leaves(arrays: Any) -> tuple[list[np.ndarray], Any]:
    leaves, treedef = jax.tree.flatten(arrays)
    if not leaves:
        raise ValueError(
            "shard_dataset got an empty pytree; pass the data arrays, e.g. {'x': x, 'y': y}."
        )
    host = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(arrays):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} is a jax.Array spread over several "
                "processes; shard_dataset takes the full host data on every process. Pass "
                "numpy arrays (every process the same), or build a Dataset yourself."
            )
        value = np.asarray(leaf)
        if value.ndim == 0:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a leading "
                "row dimension (one row per example)."
            )
        host.append(value)
    return host, treedef


def _rows(arrays: Any, leaves: list[np.ndarray]) -> int:
    rows = {
        jax.tree_util.keystr(path): leaf.shape[0]
        for (path, _), leaf in zip(jax.tree_util.tree_leaves_with_path(arrays), leaves, strict=True)
    }
    if len(set(rows.values())) > 1:
        raise ValueError(
            f"The data leaves have different numbers of rows: {rows}. Every leaf needs one "
            "row per example (the same leading dimension); check which array was "
            "transposed or cut."
        )
    count = next(iter(rows.values()))
    if count == 0:
        raise ValueError("The data has 0 rows; an objective needs at least one example.")
    return count


def shard_dataset(arrays: Any, mesh: Mesh, *, data_axis: str = "data") -> Dataset:
    """Pads ``arrays`` to a multiple of the data axis size and shards them over it.

    Padded rows repeat real rows (wrapping around), so a loss is finite on them
    wherever it is finite on the data, and the mask removes them from the objective
    exactly (with ``where``, not a multiplication). Each process passes the same full
    host arrays and builds only its own shards, with no communication.

    Args:
      arrays: a pytree of host arrays with the same number of rows ``N``.
      mesh: the mesh; it must have the axis ``data_axis``.
      data_axis: the mesh axis the rows are split over.

    Returns:
      A ``Dataset`` with ``ceil(N / d) * d`` rows, ``d`` the size of ``data_axis``.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import lbfgs
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> data = lbfgs.shard_dataset({"x": np.ones((5, 2))}, mesh)
        >>> data.num_examples, data.padded_rows % mesh.shape["data"]
        (5, 0)
    """
    mesh = check_data_axis(mesh, data_axis, where="shard_dataset")
    leaves, treedef = _host_leaves(arrays)
    count = _rows(arrays, leaves)
    shards = mesh.shape[data_axis]
    padded = math.ceil(count / shards) * shards
    rows = np.arange(padded) % count  # wrap around: padded rows repeat real ones
    sharding = NamedSharding(mesh, PartitionSpec(data_axis))

    def place(full: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])

    def pad(host: np.ndarray) -> np.ndarray:
        return host if padded == count else np.take(host, rows, axis=0)

    batch = jax.tree.unflatten(treedef, [place(pad(leaf)) for leaf in leaves])
    mask = place(np.arange(padded) < count)
    return Dataset(batch=batch, mask=mask, num_examples=count)


def classification_data(
    x: Any,
    y: Any,
    mesh: Mesh,
    *,
    num_classes: int | None = None,
    data_axis: str = "data",
    dtype: Any = np.float32,
) -> Dataset:
    """Checks features and integer labels, then shards them as ``{"x": ..., "y": ...}``.

    Args:
      x: features, shape ``[N, num_features]``.
      y: labels in ``[0, num_classes)``, shape ``[N]``, integers.
      mesh: the mesh; it must have the axis ``data_axis``.
      num_classes: the number of classes; defaults to ``max(y) + 1``.
      data_axis: the mesh axis the rows are split over.
      dtype: the floating dtype of the features on the devices.

    Returns:
      A ``Dataset`` whose batch is ``{"x": dtype[rows, F], "y": int32[rows]}``, as
      ``multiclass_logreg`` reads it.

    Raises:
      ValueError: shapes that do not match, or labels outside ``[0, num_classes)``.
      TypeError: labels that are not integers.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit import lbfgs
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> data = lbfgs.classification_data(np.ones((3, 2)), np.array([0, 2, 1]), mesh)
        >>> data.batch["x"].shape[1], data.batch["y"].dtype
        (2, dtype('int32'))
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2:
        raise ValueError(
            f"x must be 2-D [examples, features], got shape {x.shape}. Reshape it, e.g. "
            "x.reshape(len(x), -1)."
        )
    if y.ndim != 1:
        raise ValueError(
            f"y must be 1-D [examples] of integer labels, got shape {y.shape}. For one-hot "
            "labels pass y.argmax(axis=1)."
        )
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x has {x.shape[0]} rows but y has {y.shape[0]} labels; expected one label per "
            "row of x. Pass the labels that belong to these features."
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(
            f"y must hold integer class labels, got dtype {y.dtype}. Convert with "
            "y.astype(np.int32) if the values are whole numbers."
        )
    num_classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if bad.size:
        raise ValueError(
            f"Labels must lie in [0, {num_classes}) (num_classes={num_classes}); got "
            f"{y[bad[0]]} at row {bad[0]} ({bad.size} labels out of range in all). Map the "
            "labels to 0..num_classes-1 (np.unique(y, return_inverse=True)) or pass the "
            "right num_classes."
        )
    arrays = {"x": x.astype(dtype, copy=False), "y": y.astype(np.int32, copy=False)}
    return shard_dataset(arrays, mesh, data_axis=data_axis)
