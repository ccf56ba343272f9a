"""Input checks for ``LBFGS``, on the host before any tracing, each with the fix in its message."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._checks import check_int
from meshkit._pytree import Signature, abstract, leaf_dtype, signature
from meshkit.lbfgs._data import Dataset


def check_setting(name: str, value: Any, *, low: float, integer: bool = False) -> None:
    """Raises unless ``value`` is a number (an int when ``integer``) of at least ``low``."""
    if integer:
        check_int(value, name=f"LBFGS {name}", minimum=int(low))
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"LBFGS {name} must be a number >= {low}, got {type(value).__name__}: {value!r}."
        )
    if not value >= low:
        raise ValueError(f"LBFGS {name} must be a number >= {low}, got {value!r}.")


def check_strength(l2: Any, *, batched: bool) -> np.ndarray:
    """``l2`` as a float32 host array: a scalar, or (``batched``) a non-empty 1-D grid."""
    value = np.asarray(l2, np.float32)
    if (value.ndim != 1 or value.size == 0) if batched else value.ndim != 0:
        expected, fix = (
            ("a 1-D array of strengths", "For one strength use solve.")
            if batched
            else ("a scalar", "For a grid of strengths use solve_many.")
        )
        raise ValueError(f"l2 must be {expected}, got shape {value.shape}. {fix}")
    if not np.all(np.isfinite(value)) or np.any(value < 0):
        raise ValueError(f"l2 must be finite and >= 0, got {value}.")
    return value


def check_dataset(data: Any, mesh: Mesh, data_axis: str) -> Dataset:
    """Raises unless ``data`` is a ``Dataset`` split over ``data_axis`` of ``mesh``."""
    if not isinstance(data, Dataset):
        raise TypeError(
            f"LBFGS expects a meshkit.lbfgs.Dataset, got {type(data).__name__}. Pad and "
            "shard the arrays first: lbfgs.shard_dataset({'x': x, 'y': y}, mesh) or "
            "lbfgs.classification_data(x, y, mesh)."
        )
    sharding = getattr(data.mask, "sharding", None)
    expected = NamedSharding(mesh, PartitionSpec(data_axis))
    if not isinstance(sharding, NamedSharding) or not sharding.is_equivalent_to(expected, 1):
        raise ValueError(
            f"The dataset is sharded as {sharding}, but this solver expects rows split "
            f"over {data_axis!r} of its mesh {dict(mesh.shape)}. Build the dataset with "
            "the solver's mesh: shard_dataset(arrays, solver.mesh)."
        )
    return data


def check_params(params: Any) -> None:
    """Raises a clear error unless every leaf of ``params`` is a floating-point array."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("params is an empty pytree; pass the starting parameters.")
    for path, leaf in leaves:
        dtype = leaf_dtype(leaf)
        name = jax.tree_util.keystr(path) or "(root)"
        if dtype in (jnp.bfloat16, np.float16):
            raise TypeError(
                f"Parameter {name} has dtype {dtype}; L-BFGS keeps its iterates, curvature "
                "pairs and line-search values in the parameters' dtype, and a 16-bit float "
                "(8 or 11 bits of precision) is too coarse for them to converge. Pass "
                "float32 parameters (.astype(np.float32)); loss_fn may still compute in "
                f"{dtype} inside."
            )
        if not np.issubdtype(dtype, np.floating):
            raise TypeError(
                f"Parameter {name} has dtype {dtype}; L-BFGS needs float32 or float64 "
                "parameters. Start from e.g. np.zeros(shape, np.float32)."
            )


def check_loss(loss_fn: Any, params: Any, data: Dataset) -> None:
    """Checks that ``loss_fn`` accepts ``params`` and the batch and returns one loss per row.

    Runs ``jax.eval_shape`` (no computation) once per loss function and input signature.
    """
    _check_loss_once(loss_fn, signature(params), signature(data.batch))


@functools.lru_cache(maxsize=256)
def _check_loss_once(loss_fn: Any, params_signature: Signature, batch_signature: Signature) -> None:
    params, batch = abstract(params_signature), abstract(batch_signature)
    try:
        losses = jax.eval_shape(loss_fn, params, batch)
    except Exception as error:  # a user function failing on these shapes
        raise ValueError(
            f"loss_fn(params, batch) failed for params {_shapes(params)} and a batch "
            f"{_shapes(batch)}: {type(error).__name__}: {error}\nExpected parameters "
            "that fit the data (for multiclass_logreg: w of shape [num_features, "
            "num_classes] for x of shape [rows, num_features]). Check the shapes of the "
            "starting parameters and of the data."
        ) from error
    rows = jax.tree.leaves(batch)[0].shape[0]
    if not isinstance(losses, jax.ShapeDtypeStruct) or losses.shape != (rows,):
        got = getattr(losses, "shape", type(losses).__name__)
        raise ValueError(
            f"loss_fn must return one loss per example, shape ({rows},) for this batch "
            f"(its padded row count), got {got}. Return the per-example losses, not their "
            "mean: the solver masks the padded rows and divides by the real row count."
        )
    if not np.issubdtype(losses.dtype, np.floating):
        raise TypeError(f"loss_fn must return floating-point losses, got dtype {losses.dtype}.")


def _shapes(tree: Any) -> str:
    return str(jax.tree.map(lambda leaf: f"{leaf_dtype(leaf)}{list(np.shape(leaf))}", tree))
