"""``pad_shard_unpad``: the jit-era replacement for ``flax.jax_utils.pad_shard_unpad``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from meshkit._batch import batch_sharding, data_shard, pad_rows, row_blocks, shard_batch
from meshkit._host import to_host
from meshkit._mesh import DATA_AXIS, check_data_axis
from meshkit._pytree import leading_rows


def _padded_rows(rows: int, min_batch: int | None, multiple: int) -> int:
    """Rows per process after padding: the same on every process, a multiple of ``multiple``."""
    if min_batch is not None and rows > min_batch:
        raise ValueError(
            f"pad_shard_unpad got {rows} rows but min_batch={min_batch}; min_batch must be "
            "at least the largest batch, so that every call has one shape and one compile."
        )
    target = min_batch if min_batch is not None else rows
    if min_batch is None and jax.process_count() > 1:
        # Processes may hold different numbers of rows: agree on the largest.
        target = int(np.max(multihost_utils.process_allgather(np.int64(rows))))
    return max(multiple, -(-target // multiple) * multiple)


def _batch_sharding(sharding: Mesh | NamedSharding, data_axis: str) -> NamedSharding:
    """The batch sharding: over ``data_axis`` of a mesh, or the sharding given."""
    if not isinstance(sharding, NamedSharding):
        mesh = check_data_axis(sharding, data_axis, where="pad_shard_unpad")
        return batch_sharding(mesh, data_axis)
    if data_axis != DATA_AXIS:
        raise ValueError(
            f"pad_shard_unpad got data_axis={data_axis!r} and a batch sharding "
            f"({sharding.spec}), which already names its data axes. Pass the mesh "
            "instead, or drop data_axis."
        )
    return sharding


def _static_names(static_argnames: str | Sequence[str]) -> tuple[str, ...]:
    """``static_argnames`` as a tuple of names (a single name may be given as a string)."""
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise TypeError(
            f"pad_shard_unpad got static_argnames={static_argnames!r}, with {wrong!r} not a "
            "string; pass the names of keyword arguments, e.g. static_argnames=('train',)."
        )
    return names


def _batched(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_argnums: tuple[int, ...],
    static_argnames: tuple[str, ...],
) -> dict[str, dict[Any, Any]]:
    """The arguments to pad and shard: ``{"args": {position: value}, "kwargs": {name: value}}``.

    Raises:
      ValueError: a batched argument holds a scalar, which has no rows to pad; the
        message names the argument and says how to pass it through unchanged.
    """
    batched = {
        "args": {i: arg for i, arg in enumerate(args) if i not in static_argnums},
        "kwargs": {name: arg for name, arg in kwargs.items() if name not in static_argnames},
    }
    for kind, group in batched.items():
        for key, arg in group.items():
            for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
                if np.ndim(leaf) == 0:
                    raise ValueError(_scalar_message(kind, key, jax.tree_util.keystr(path), leaf))
    return batched


def _scalar_message(kind: str, key: int | str, path: str, leaf: Any) -> str:
    """Why a scalar cannot be a batched argument, and how to pass it through instead."""
    if kind == "args":
        where, fix = f"argument {key}", f"add {key} to static_argnums"
    else:
        where, fix = f"keyword argument {key!r}", f"give static_argnames=({key!r},)"
    return (
        f"pad_shard_unpad got {where}{path} = {leaf!r}, a scalar: batched arguments need "
        "a leading row dimension to pad and shard. To pass it through unchanged (a "
        f"parameter, a flag, a jitted function's static argument), {fix}."
    )


def pad_shard_unpad(
    fn: Callable[..., Any],
    sharding: Mesh | NamedSharding,
    *,
    static_argnums: Sequence[int] = (0,),
    static_argnames: str | Sequence[str] = (),
    min_batch: int | None = None,
    static_return: bool = False,
    with_mask: bool = False,
    data_axis: str = DATA_AXIS,
) -> Callable[..., Any]:
    """Wraps a jitted ``fn`` so it takes any number of rows and returns exactly those rows.

    Each batched argument (positional ones not in ``static_argnums``, keyword ones not
    in ``static_argnames``, as in ``flax.jax_utils.pad_shard_unpad``) is padded with
    zeros along its leading dimension to a multiple of the data shards (or to
    ``min_batch`` rows, so that a short last batch keeps the same shape and does not
    recompile), turned into a global array sharded over the data axis, and passed to
    ``fn``. Static arguments, positional or keyword, are passed through unchanged
    (parameters, flags, a jitted ``fn``'s own ``static_argnames``). Outputs are
    brought back to the host and cut to the original rows; with ``static_return`` they
    are returned as they are (for metrics that ``fn`` already reduced: pass
    ``with_mask=True`` so it receives ``mask=`` and can ignore the padding).

    On several processes each process passes its own rows and gets its own rows back;
    give ``min_batch`` (at least every process's row count) to avoid the small
    all-gather that otherwise agrees on the padded size.

    Args:
      fn: the function to call, typically ``jax.jit``-compiled.
      sharding: a mesh (the batch goes over its ``data_axis`` axis) or a batch sharding.
      static_argnums: positions of arguments that are not batched (parameters).
      static_argnames: names of keyword arguments that are not batched; other keyword
        arguments are batched, and a scalar among them is an error naming it.
      min_batch: rows to pad every call to (per process).
      static_return: return ``fn``'s outputs without unpadding.
      with_mask: pass ``mask=`` (``True`` on real rows) to ``fn``.
      data_axis: the mesh axis the rows are split over, when ``sharding`` is a mesh.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, meshkit
        >>> from meshkit.evaluate import pad_shard_unpad
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> predict = jax.jit(lambda w, x: x @ w)
        >>> padded = pad_shard_unpad(predict, mesh, min_batch=64)
        >>> padded(jnp.ones((3, 2)), np.ones((5, 3))).shape
        (5, 2)
        >>> scaled = jax.jit(lambda w, x, *, bias: x * w + bias, static_argnames=("bias",))
        >>> add_bias = pad_shard_unpad(scaled, mesh, static_argnames=("bias",))
        >>> add_bias(2, np.ones(3), bias=1).tolist()
        [3.0, 3.0, 3.0]
    """
    batch = _batch_sharding(sharding, data_axis)
    blocks = row_blocks(batch)
    static_nums = tuple(static_argnums)
    static_names = _static_names(static_argnames)
    del static_argnums, static_argnames

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if with_mask and "mask" in kwargs:
            raise ValueError(
                "pad_shard_unpad was built with with_mask=True, so it passes mask= itself, "
                "but the call passed mask= too. Drop one of them."
            )
        batched = _batched(args, kwargs, static_nums, static_names)
        rows = leading_rows(
            batched,
            what="pad_shard_unpad",
            fix="Mark arguments that are not batched (parameters, state) with static_argnums "
            "or, for keyword arguments, static_argnames.",
        )
        padded_rows = _padded_rows(rows, min_batch, blocks.shards_per_block)
        global_rows = padded_rows * blocks.count
        local, mask = pad_rows(batched, padded_rows)
        placed = shard_batch(local, batch, global_batch_size=global_rows)
        call = [placed["args"].get(i, arg) for i, arg in enumerate(args)]
        call_kwargs = {**kwargs, **placed["kwargs"]}
        if with_mask:
            call_kwargs["mask"] = shard_batch(mask, batch, global_batch_size=global_rows)
        outputs = fn(*call, **call_kwargs)
        if static_return:
            return outputs
        mine = data_shard(batch, global_rows).slice
        return jax.tree.map(lambda out: to_host(out)[mine][:rows], outputs)

    return wrapper
