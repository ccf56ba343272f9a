"""A checksum of a pytree's bits, computed on the devices, the same on any mesh, and its check."""

from __future__ import annotations

import contextlib
import json
import threading
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit._host import to_host
from meshkit._pytree import path_str

_GOLDEN = 0x9E3779B1  # odd: 2^32 / golden ratio, spreads positions over all 32 bits


def _bits_u32(x: jax.Array) -> jax.Array:
    """The raw bits of ``x`` as ``uint32`` (8- and 16-bit values widened, 64-bit split in two)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _position_u32(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position, modulo 2^32, built without flattening."""
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
        position = position + iota * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return position


def _leaf_digest(x: jax.Array) -> jax.Array:
    """Two ``uint32`` sums of ``bits * weight``, each weight odd and position-dependent.

    Integer sums wrap modulo 2^32, so they are exact in any reduction order (any
    sharding gives the same result); an odd weight makes every single-bit change
    change the sum; two weightings make a compensating multi-byte change unlikely.
    """
    bits = _bits_u32(x)
    position = _position_u32(bits.shape)
    linear = position * jnp.uint32(2) + jnp.uint32(1)
    mixed = (position * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
    return jnp.stack([jnp.sum(bits * linear), jnp.sum(bits * mixed)])


@jax.jit
def _digest_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_leaf_digest(leaf) for leaf in leaves]


def _host_leaf_digest(x: np.ndarray) -> list[int]:
    """``_leaf_digest`` in numpy, on a whole array in host memory."""
    if x.dtype == np.bool_:
        bits = x.astype(np.uint64).reshape(-1)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
        bits = np.ascontiguousarray(x).reshape(-1).view(unsigned).astype(np.uint64)
    position = np.arange(bits.size, dtype=np.uint64)
    linear = (2 * position + 1) % 2**32
    mixed = (position * _GOLDEN) % 2**32 | 1
    return [int((bits * linear % 2**32).sum() % 2**32), int((bits * mixed % 2**32).sum() % 2**32)]


def _digests_on_host(arrays: list[jax.Array]) -> bool:
    """Whether the digest is computed in numpy: on one process of CPU devices, where
    the arrays are in host memory already and a program would only add its compile
    (the same sums, tested), for arrays of 8-, 16- and 32-bit values."""
    return jax.process_count() == 1 and all(
        array.is_fully_addressable
        and all(device.platform == "cpu" for device in array.sharding.device_set)
        and not jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key)
        and not jnp.issubdtype(array.dtype, jnp.complexfloating)
        and array.dtype.itemsize <= 4
        for array in arrays
    )


def tree_digest(tree: Any, *, on_host: bool | None = None) -> dict[str, list[int]]:
    """Two ``uint32`` checksums of each leaf's bits, under the leaf's path.

    One jitted reduction on the devices where the leaves live; only the checksums
    reach the host. The result depends on the values only, not on the mesh, the
    sharding or the number of processes. With several processes it is a collective:
    every process calls it with the same tree. ``on_host`` computes the same sums in
    numpy (``None``: on one process of CPU devices, where that skips a compile).

    Examples:
        >>> import jax.numpy as jnp
        >>> digest = tree_digest({"w": jnp.ones(3), "step": jnp.int32(7)})
        >>> sorted(digest), digest["step"]  # bits 7 at position 0: both weights are 1
        (['step', 'w'], [7, 7])
        >>> tree_digest({"w": jnp.ones(3).at[1].set(1.0000001)})["w"] != digest["w"]
        True
    """
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree), strict=True) or ((), ())
    arrays = [leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf) for leaf in leaves]
    if _digests_on_host(arrays) if on_host is None else on_host:
        sums = [_host_leaf_digest(np.asarray(array)) for array in arrays]
        return {path_str(path): s for path, s in zip(paths, sums, strict=True)}
    sums: list[Any] = [None] * len(arrays)
    for indices in _device_groups(arrays):
        for i, s in zip(
            indices, to_host(_digest_leaves([arrays[i] for i in indices])), strict=True
        ):
            sums[i] = s
    return {path_str(path): [int(v) for v in s] for path, s in zip(paths, sums, strict=True)}


def _device_groups(arrays: list[jax.Array]) -> list[list[int]]:
    """The indices of ``arrays`` by the set of devices they live on: one program each."""
    groups: dict[frozenset[Any], list[int]] = {}
    for i, array in enumerate(arrays):
        groups.setdefault(frozenset(array.sharding.device_set), []).append(i)
    return list(groups.values())


class DigestCompile:
    """``tree_digest``'s programs for trees like ``tree``, compiled in a background thread.

    On accelerators, and on CPUs with several processes, the digest is a jitted
    program whose compile a first save would otherwise wait for; compiled here while
    the train step compiles, the save finds it in the jitted function's cache. Nothing
    to compile where the digest is computed in numpy, or where a leaf is not a
    ``jax.Array``. Reads only the leaves' shapes, dtypes and shardings, here, so the
    tree may be donated to a step right after.

    Examples:
        >>> import jax.numpy as jnp
        >>> ahead = DigestCompile({"w": jnp.ones(3)})
        >>> ahead.wait()  # returns once compiled; a failure is the later call's to report
    """

    def __init__(self, tree: Any):
        leaves = jax.tree_util.tree_leaves(tree)
        self._thread: threading.Thread | None = None
        if not all(isinstance(leaf, jax.Array) for leaf in leaves) or _digests_on_host(leaves):
            return
        abstract = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
            for a in leaves
        ]
        groups = [[abstract[i] for i in indices] for indices in _device_groups(leaves)]
        self._thread = threading.Thread(
            target=_compile_quietly, args=(groups,), name="meshkit-digest-compile", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Returns once the compile is done (at once where there was none)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _compile_quietly(groups: list[list[jax.ShapeDtypeStruct]]) -> None:
    for group in groups:
        with contextlib.suppress(Exception):  # the digest's own call raises it, in context
            _digest_leaves.lower(group).compile()


def digest_damage(saved: dict[str, list[int]], tree: Any) -> str:
    """``""`` if ``tree``'s digest matches ``saved``, else which leaves differ, in a few words.

    A collective with several processes, like ``tree_digest``.

    Examples:
        >>> import jax.numpy as jnp
        >>> saved = tree_digest({"w": jnp.ones(3)})
        >>> digest_damage(saved, {"w": jnp.ones(3)})
        ''
        >>> digest_damage(saved, {"w": jnp.zeros(3)})
        '1 of 1 arrays differ from the digest saved with it (w)'
    """
    read = tree_digest(tree)
    differ = [
        path for path in sorted(saved.keys() | read.keys()) if saved.get(path) != read.get(path)
    ]
    if not differ:
        return ""
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return f"{len(differ)} of {len(saved)} arrays differ from the digest saved with it ({shown})"


DATA_STATE_KEY = "<data state>"
"""The digest's entry for the data state (no leaf path has angle brackets)."""


def json_digest(value: Any) -> list[int]:
    """Two checksums (CRC-32, Adler-32) of ``value`` as canonical JSON (sorted keys).

    Examples:
        >>> json_digest({"step": 20}) == json_digest({"step": 20})
        True
        >>> json_digest({"step": 20}) != json_digest({"step": 25})
        True
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return [zlib.crc32(text), zlib.adler32(text)]


def checkpoint_digest(state: Any, data: dict[str, Any]) -> dict[str, list[int]]:
    """The digest a checkpoint holds: ``tree_digest(state)`` and the data state's."""
    return {**tree_digest(state), DATA_STATE_KEY: json_digest(data)}


def checkpoint_damage(saved: dict[str, list[int]], state: Any, data: dict[str, Any]) -> str:
    """``""`` if ``state`` and ``data`` match a ``checkpoint_digest``, else what differs.

    A digest saved before it covered the data state checks the state alone.
    """
    saved = dict(saved)
    data_saved = saved.pop(DATA_STATE_KEY, None)
    damage = digest_damage(saved, state)
    if damage or data_saved is None or data_saved == json_digest(data):
        return damage
    return (
        f"its data state {json.dumps(data, sort_keys=True)[:200]} differs from the digest "
        "saved with it (the data iterator's position would be wrong)"
    )
