"""A full dataset padded to the mesh and sharded over the data axis, with a mask of real rows."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._batch import pad_rows
from meshkit._host import place_global
from meshkit._mesh import DATA_AXIS, check_data_axis
from meshkit._pytree import leading_rows


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


def _check_host_data(arrays: Any) -> None:
    """Rejects leaves that no single process holds in full."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(arrays):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path)} is a jax.Array spread over several "
                "processes; shard_dataset takes the full host data on every process. Pass "
                "numpy arrays (every process the same), or build a Dataset yourself."
            )


def shard_dataset(arrays: Any, mesh: Mesh, *, data_axis: str = DATA_AXIS) -> Dataset:
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
    _check_host_data(arrays)
    count = leading_rows(
        arrays, what="shard_dataset", fix="Check which array was transposed or cut."
    )
    if count == 0:
        raise ValueError("The data has 0 rows; an objective needs at least one example.")
    shards = mesh.shape[data_axis]
    batch, mask = pad_rows(arrays, math.ceil(count / shards) * shards, fill="wrap")
    sharding = NamedSharding(mesh, PartitionSpec(data_axis))
    return Dataset(
        batch=place_global(batch, sharding),
        mask=place_global(mask, sharding),
        num_examples=count,
    )


def classification_data(
    x: Any,
    y: Any,
    mesh: Mesh,
    *,
    num_classes: int | None = None,
    data_axis: str = DATA_AXIS,
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
    if y.shape[0] == 0:
        raise ValueError(
            "classification_data got 0 examples (x has shape "
            f"{x.shape}); a full-batch solve needs at least one row. Check the file or "
            "the filter that produced x and y."
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
