"""Moving pytrees between the host and a mesh: the jit-era replicate/unreplicate."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec


def replicated_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """The sharding that puts a full copy of an array on every device of ``mesh``.

    An ``AbstractMesh`` (a sharding's mesh inside a trace) gives an abstract sharding.

    Examples:
        >>> import meshkit
        >>> from meshkit._host import replicated_sharding
        >>> replicated_sharding(meshkit.make_mesh("data=-1")).spec
        P()
    """
    return NamedSharding(mesh, PartitionSpec())


def place_global(tree: Any, sharding: NamedSharding, *, copy: bool = False) -> Any:
    """Places every leaf of ``tree``, a full global value, as a ``jax.Array`` with ``sharding``.

    Every process passes the same full values and builds only its own shards from
    them (``jax.make_array_from_callback``), with no cross-process communication. A
    ``jax.Array`` spread over several processes is resharded by an identity
    ``jax.jit`` instead. For per-process rows of a batch, use ``shard_batch``.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit._host import place_global
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> x = place_global(np.arange(8.0), meshkit.batch_sharding(mesh))
        >>> x.shape, x.sharding.spec
        ((8,), P('data',))
    """

    def put(leaf: Any) -> jax.Array:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return jax.jit(lambda x: x, out_shardings=sharding)(leaf)
        if jax.process_count() == 1:
            if copy and isinstance(leaf, jax.Array):
                # A copy of our own first: device_put's may_alias=False still lets the
                # first device's shard share the input's buffer when it reshards (JAX
                # 0.10), and a donating step would then delete the caller's array.
                leaf = jnp.copy(leaf)
            return jax.device_put(leaf, sharding, may_alias=False if copy else None)
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of ``tree`` fully replicated on ``mesh``.

    The replacement for ``flax.jax_utils.replicate``: no leading device axis is
    added; each leaf becomes one global ``jax.Array`` with ``PartitionSpec()``. Host
    values are copied straight to this process's devices, with no cross-process
    communication, so every process must pass the same values. Like Flax's
    ``replicate``, the result never shares memory with a ``jax.Array`` passed in, so a
    train step that donates the result does not delete the caller's array. For large
    sharded state, prefer building it under ``jax.jit(..., out_shardings=...)``.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> params = meshkit.replicate({"w": np.ones(3)}, mesh)
        >>> params["w"].sharding.is_fully_replicated
        True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"replicate needs a jax.sharding.Mesh, got {type(mesh).__name__}.")
    return place_global(tree, replicated_sharding(mesh), copy=True)


def to_host(tree: Any) -> Any:
    """Copies every leaf of ``tree`` to a numpy array holding its full global value.

    The replacement for ``flax.jax_utils.unreplicate``. Arrays that this process
    can read in full (single process, or fully replicated) are copied locally;
    arrays sharded across processes are all-gathered, so with several processes
    every process must call ``to_host`` on the same tree (it is a collective). Typed
    PRNG keys come back as their ``key_data``.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> batch = meshkit.shard_batch(np.arange(8), meshkit.batch_sharding(mesh))
        >>> meshkit.to_host(batch).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return jax.tree.map(array_to_host, tree)


def array_to_host(leaf: Any) -> np.ndarray:
    """``to_host`` of one array (a collective where it is sharded across processes)."""
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if leaf.is_fully_addressable:
        return np.asarray(leaf)
    if leaf.is_fully_replicated:
        return np.asarray(leaf.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def text_row(text: str, size: int) -> np.ndarray:
    """``text`` as ``size`` bytes (cut, or padded with zeros) for a collective between
    processes, which exchanges arrays of one shape; ``row_text`` reads it back.

    Examples:
        >>> row_text(text_row("step 4 is damaged", 32))
        'step 4 is damaged'
    """
    row = np.zeros(size, np.uint8)
    encoded = text.encode()[:size]
    row[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    return row


def row_text(row: np.ndarray) -> str:
    """The text of a ``text_row`` (``""`` for a row of zeros)."""
    return bytes(np.asarray(row, np.uint8)).rstrip(b"\0").decode(errors="replace")
