"""Process-local batches in, global ``jax.Array`` batches out."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._checks import check_int
from meshkit._mesh import DATA_AXIS, check_axis_names
from meshkit._pytree import leading_rows
from meshkit._specs import spec_axis_names


def batch_sharding(mesh: Mesh, data_axes: str | Sequence[str] = DATA_AXIS) -> NamedSharding:
    """The sharding of a batch: leading (example) dimension split over ``data_axes``.

    Every other dimension is replicated. Axes of the mesh that are not in
    ``data_axes`` hold replicas of the same rows.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> meshkit.batch_sharding(mesh).spec
        P('data',)
    """
    names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if not names:
        raise ValueError("data_axes is empty; name at least one mesh axis, e.g. 'data'.")
    check_axis_names(mesh, names, what=f"data_axes={names}")
    return NamedSharding(mesh, PartitionSpec(names[0] if len(names) == 1 else names))


@dataclasses.dataclass(frozen=True)
class DataShard:
    """The rows of each global batch that this process must load.

    Attributes:
      start: first row (inclusive) of the global batch this process loads.
      stop: last row (exclusive).
      index: which of the ``count`` distinct row blocks this is. Processes that hold
        replicas of the same rows get the same ``index`` and must load identical data.
      count: how many distinct row blocks the processes hold between them.
    """

    start: int
    stop: int
    index: int
    count: int

    @property
    def size(self) -> int:
        """Rows per global batch loaded by this process."""
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        """``slice(start, stop)``, to cut this process's rows out of a global batch."""
        return slice(self.start, self.stop)


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """How a batch sharding splits the rows of every global batch between processes.

    The leading dimension is split into ``count * shards_per_block`` equal shards;
    each process holds ``shards_per_block`` neighbouring shards, one row block.
    Processes that hold replicas of the same rows share a block (and its ``index``).
    Independent of the batch size: ``data_shard`` turns it into row numbers.

    Attributes:
      count: how many distinct row blocks the processes hold between them.
      index: which block this process holds, in ``[0, count)``.
      shards_per_block: leading-dimension shards in one block; the rows a process
        loads per batch come in multiples of this.
    """

    count: int
    index: int
    shards_per_block: int

    @property
    def shards(self) -> int:
        """Shards of the leading dimension in all (the product of the data axes' sizes)."""
        return self.count * self.shards_per_block


def leading_dim_shards(sharding: NamedSharding) -> int:
    """Shards of the leading dimension: the product of the sizes of its mesh axes."""
    spec = sharding.spec
    if len(spec) == 0 or spec[0] is None:
        return 1
    return int(np.prod([sharding.mesh.shape[name] for name in spec_axis_names(spec[:1])]))


def _check_batch_sharding(sharding: Any) -> NamedSharding:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"Expected a jax.sharding.NamedSharding for the batch, got {sharding!r} "
            f"({type(sharding).__name__}). "
            "Build one with meshkit.batch_sharding(mesh)."
        )
    return sharding


def row_blocks(sharding: NamedSharding) -> RowBlocks:
    """The distinct row blocks ``sharding`` gives the processes, and which one is this one's.

    Computed once per sharding (and process).

    Examples:
        >>> import meshkit
        >>> from meshkit._batch import row_blocks
        >>> blocks = row_blocks(meshkit.batch_sharding(meshkit.make_mesh("data=-1")))
        >>> blocks.count, blocks.index
        (1, 0)
    """
    return _row_blocks(_check_batch_sharding(sharding), jax.process_index())


@functools.lru_cache(maxsize=64)
def _row_blocks(sharding: NamedSharding, process: int) -> RowBlocks:
    shards = leading_dim_shards(sharding)
    indices = sharding.devices_indices_map((shards,))  # one row per shard: row = shard
    mine = sorted(
        {
            index[0].start or 0
            for device, index in indices.items()
            if device.process_index == process
        }
    )
    if not mine:
        raise ValueError(
            f"Process {process} has no device in the mesh of this sharding, so it "
            "holds no rows. Build the mesh from all devices (meshkit.make_mesh does)."
        )
    per_block = len(mine)
    if (
        mine != list(range(mine[0], mine[0] + per_block))
        or mine[0] % per_block
        or shards % per_block
    ):
        raise ValueError(
            f"Process {process} holds row shards {mine} of {shards}; meshkit needs each "
            "process's rows to be one aligned, contiguous block. Build the mesh with "
            "meshkit.make_mesh, which keeps a process's devices together."
        )
    return RowBlocks(
        count=shards // per_block, index=mine[0] // per_block, shards_per_block=per_block
    )


def data_shard(sharding: NamedSharding, global_batch_size: int) -> DataShard:
    """Which rows of each global batch this process must load.

    Derived from the sharding, not from ``jax.process_index()``: when an axis that
    is not a data axis spans processes, several processes hold the same rows and must
    load the same data.

    Args:
      sharding: the batch sharding, e.g. from ``batch_sharding``.
      global_batch_size: rows per global batch.

    Returns:
      The rows ``start`` (inclusive) to ``stop`` (exclusive) of each global batch, as
      ``slice`` and ``size`` too; and ``index``, which of the ``count`` distinct row
      blocks this is (processes holding replicas of the same rows get the same
      ``index`` and must load identical data): a pipeline's shard id and shard count.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> shard = meshkit.data_shard(meshkit.batch_sharding(mesh), 64)
        >>> (shard.start, shard.stop, shard.count)
        (0, 64, 1)
    """
    blocks = row_blocks(sharding)
    global_batch_size = check_int(global_batch_size, name="global_batch_size")
    return _block_rows(blocks, sharding, global_batch_size)


def _block_rows(blocks: RowBlocks, sharding: NamedSharding, global_batch_size: int) -> DataShard:
    """This process's rows of a global batch of ``global_batch_size`` rows."""
    if global_batch_size <= 0 or global_batch_size % blocks.shards:
        raise ValueError(
            f"Global batch size {global_batch_size} must be a positive multiple of the "
            f"{blocks.shards} shards of the data axes {sharding.spec[0]!r} "
            f"(mesh {dict(sharding.mesh.shape)}). "
            f"Use a batch size divisible by {blocks.shards}, or pad the last batch "
            "(meshkit pads evaluation batches with a mask)."
        )
    rows = global_batch_size // blocks.count
    return DataShard(
        start=blocks.index * rows,
        stop=(blocks.index + 1) * rows,
        index=blocks.index,
        count=blocks.count,
    )


def pad_rows(
    batch: Any, rows: int, *, fill: Literal["zeros", "wrap"] = "zeros"
) -> tuple[Any, np.ndarray]:
    """Pads every leaf of ``batch`` to ``rows`` rows on the host; returns it and its mask.

    The step before ``shard_batch`` when a batch is short (the last one of an
    evaluation, a process with fewer rows): every call keeps one shape, so a jitted
    step compiles once, and the mask says which rows count. The real rows come first.
    ``fill="zeros"`` appends rows of zeros; ``fill="wrap"`` repeats the real rows from
    the first one, so that a function finite on the data is finite on the padding too.

    Args:
      batch: a pytree of arrays sharing their leading (row) dimension.
      rows: rows after padding, at least the rows of ``batch``.
      fill: what the padded rows hold.

    Returns:
      ``(padded, mask)``: the padded numpy pytree and ``bool[rows]``, ``True`` on the
      real rows.

    Examples:
        >>> import numpy as np
        >>> padded, mask = pad_rows({"x": np.array([1, 2])}, 4, fill="wrap")
        >>> padded["x"].tolist(), mask.tolist()
        ([1, 2, 1, 2], [True, True, False, False])
    """
    count = leading_rows(batch, what="pad_rows")
    if count > rows:
        raise ValueError(
            f"pad_rows got {count} rows, more than the {rows} rows to pad to; pass rows >= {count}."
        )
    if fill == "wrap" and count == 0 and rows > 0:
        raise ValueError("pad_rows cannot wrap around 0 rows; pass fill='zeros' or some rows.")

    def pad(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        if count == rows:
            return leaf
        if fill == "wrap":
            return np.take(leaf, np.arange(rows) % count, axis=0)
        return np.concatenate([leaf, np.zeros((rows - count, *leaf.shape[1:]), leaf.dtype)])

    return jax.tree.map(pad, batch), np.arange(rows) < count


def _digest(local_batch: Any) -> int:
    digest = hashlib.blake2b(digest_size=7)
    for leaf in jax.tree.leaves(local_batch):
        digest.update(np.ascontiguousarray(leaf).data)
    return int.from_bytes(digest.digest(), "little")


def _global_batch_size(local_batch: Any, local_rows: int, blocks: RowBlocks) -> int:
    """Infers the global batch size, checking that processes agree on rows and replicas."""
    if jax.process_count() == 1:
        return local_rows
    mine = np.array([local_rows, blocks.index, _digest(local_batch)], dtype=np.int64)
    gathered = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
    rows = gathered[:, 0].tolist()
    if len(set(rows)) > 1:
        raise ValueError(
            f"Processes passed different numbers of rows to shard_batch: "
            f"{dict(enumerate(rows))} (process: rows). Every process must load "
            "the same number of rows per batch; drop the global remainder for training, "
            "and pad evaluation batches with a mask."
        )
    for index in set(gathered[:, 1].tolist()):
        replicas = np.flatnonzero(gathered[:, 1] == index)
        if len(set(gathered[replicas, 2].tolist())) > 1:
            raise ValueError(
                f"Processes {replicas.tolist()} hold replicas of the same rows (row block "
                f"{index} of {blocks.count}) but passed different data. Choose rows with "
                "meshkit.data_shard(sharding, global_batch_size).slice, not with "
                "jax.process_index(): replicas must load identical rows."
            )
    return local_rows * blocks.count


def shard_batch(
    local_batch: Any, sharding: NamedSharding, *, global_batch_size: int | None = None
) -> Any:
    """Turns this process's rows into global ``jax.Array``s.

    Args:
      local_batch: a pytree of arrays whose leading dimension holds this process's
        rows, i.e. rows ``data_shard(sharding, global_batch_size).slice`` of the global
        batch.
      sharding: the batch sharding, e.g. from ``batch_sharding``.
      global_batch_size: rows in the global batch. When given, no cross-process
        communication is needed. When omitted on several processes, one small
        all-gather infers it and checks that all processes passed the same number of
        rows and that replicas passed identical data (pass it in hot loops).

    Returns:
      The same pytree with global ``jax.Array`` leaves sharded by ``sharding``.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> sharding = meshkit.batch_sharding(mesh)
        >>> batch = meshkit.shard_batch({"x": np.ones((8, 3))}, sharding)
        >>> batch["x"].shape
        (8, 3)
    """
    blocks = row_blocks(sharding)
    rows = leading_rows(local_batch, what="shard_batch")
    if global_batch_size is None:
        global_batch_size = _global_batch_size(local_batch, rows, blocks)
    global_batch_size = check_int(global_batch_size, name="global_batch_size")
    shard = _block_rows(blocks, sharding, global_batch_size)
    if rows != shard.size:
        raise ValueError(
            f"Process {jax.process_index()} passed {rows} rows, but a global batch of "
            f"{global_batch_size} on mesh {dict(sharding.mesh.shape)} puts rows "
            f"[{shard.start}, {shard.stop}) ({shard.size} rows) on this process. Load "
            "meshkit.data_shard(sharding, global_batch_size).slice of each global batch."
        )

    return place_local_rows(local_batch, sharding, global_batch_size)


def place_local_rows(local_batch: Any, sharding: NamedSharding, global_batch_size: int) -> Any:
    """``shard_batch`` without its checks, for batches built to fit (a pipeline's own).

    Three ways, by layout, all giving the same global arrays:

    - one CPU device: the host arrays go through an identity ``jax.jit``, whose
      argument transfer is done by JAX's C++ dispatch (about 3× cheaper per batch than
      ``jax.device_put``'s Python path on a CPU). On one GPU it is the other way round
      (0.37 and 0.42 ms against 0.31 ms on an H100, batches of 64 and 128 images;
      both measured in the fit benchmark), so accelerators take ``jax.device_put``;
    - several devices, one process: one batched ``jax.device_put``;
    - several processes: each process contributes its rows with
      ``jax.make_array_from_process_local_data``.
    """
    return _place_rows(local_batch, sharding, lambda shape: (global_batch_size, *shape[1:]))


def place_stacked_rows(local: Any, sharding: NamedSharding, global_batch_size: int) -> Any:
    """Several steps' rows at once: leaves ``(steps, local rows, ...)`` become global arrays
    ``(steps, global_batch_size, ...)`` whose axis 1 is split like ``sharding`` (this
    process gives its rows; axis 0 is whole on every device).

    One transfer for a chunk of steps: their batches (host input) or their source
    indices (resident data).
    """
    return _place_rows(
        local,
        stacked_sharding(sharding),
        lambda shape: (shape[0], global_batch_size, *shape[2:]),
    )


def _place_rows(
    local: Any, sharding: NamedSharding, global_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
) -> Any:
    """Host leaves to global arrays on ``sharding``; ``global_shape`` maps a local leaf's
    shape to its global one (several processes each give their rows)."""
    if jax.process_count() == 1:
        leaves = jax.tree.leaves(local)
        if _identity_jit_places_faster(sharding) and all(
            isinstance(leaf, np.ndarray) for leaf in leaves
        ):
            return _one_device_put(sharding)(local)
        return jax.device_put(local, sharding)

    def to_global(leaf: Any) -> jax.Array:
        leaf = np.asarray(leaf)
        return jax.make_array_from_process_local_data(sharding, leaf, global_shape(leaf.shape))

    return jax.tree.map(to_global, local)


@functools.lru_cache(maxsize=16)
def stacked_sharding(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` with a leading step axis, whole on every device."""
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def _identity_jit_places_faster(sharding: NamedSharding) -> bool:
    """Whether one batch reaches ``sharding`` faster through an identity ``jax.jit``
    than through ``jax.device_put``: on one CPU device only."""
    if sharding.num_devices != 1:
        return False
    return next(iter(sharding.device_set)).platform == "cpu"


@functools.lru_cache(maxsize=16)
def _one_device_put(sharding: NamedSharding) -> Any:
    def place_on_one_device(tree: Any) -> Any:
        return tree

    return jax.jit(place_on_one_device, out_shardings=sharding)
