"""A dataset placed on the devices once, and batches gathered from it on the devices.

A small in-memory dataset (the digits, MNIST, CIFAR-10) fits on every accelerator many
times over. Copying each batch from the host costs more than the step of a small
model, so a resident pipeline copies the whole dataset once, and ``fit`` places the
batches' source indices (``int32[rows]`` a step) for many steps at once; the rows are
gathered on the devices.

Two layouts, chosen by size against ``resident_limit_bytes`` per device:

- replicated: every device holds the whole dataset; each device gathers its own rows
  of the batch (no communication);
- sharded: the dataset's rows are split over the batch's data axes; each device
  gathers the batch rows it holds, zeros elsewhere, and a reduce-scatter over the data
  axes hands every device its rows of the batch (one collective of one batch's size).

Either way the batch equals, bit for bit, the one the host pipeline builds from the
same indices: the gather copies the stored values, and the sharded layout adds them
as unsigned integers of the same width (a value plus zeros), so no bit pattern (not
even ``-0.0`` or a NaN payload) changes.

A deterministic transform (decoding images, an evaluation's centre crop) runs once,
over every example, when the dataset is placed (``read_all``): a resident JPEG dataset
is decoded once, not once per epoch.

An evaluation set is placed as its padded batches (``place_eval_batches``): batch
``k``'s rows sit on the devices that evaluate them, so an evaluation step slices
its batch locally and nothing is gathered at all.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from meshkit._batch import leading_dim_shards, pad_rows
from meshkit._describe import format_bytes
from meshkit._specs import spec_axis_names

ResidentMode = Literal["replicated", "sharded"]

RESIDENT_SHARE = 0.25
"""The share of a device's memory a resident dataset may take by default; the rest is
left for the model, its optimizer state and the step's activations."""

LIMIT_VARIABLE = "MESHKIT_RESIDENT_BYTES"
"""Environment variable: the bytes per device a resident dataset may take (overrides
``RESIDENT_SHARE`` of the device's memory)."""


def device_memory_bytes(device: Any) -> int:
    """A device's memory: its allocator's limit on accelerators, a share of RAM on CPUs.

    CPU devices (fake devices included) share the host's memory, so each is given an
    equal part of it.
    """
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, jax.local_device_count())


def resident_limit_bytes(device: Any) -> tuple[int, str]:
    """The bytes per device a resident dataset may take, and where the figure came from."""
    value = os.environ.get(LIMIT_VARIABLE)
    if value:
        try:
            return int(float(value)), f"{LIMIT_VARIABLE}={value}"
        except ValueError:
            raise ValueError(
                f"{LIMIT_VARIABLE} must be a number of bytes per device, got {value!r}."
            ) from None
    memory = device_memory_bytes(device)
    share = int(memory * RESIDENT_SHARE)
    return share, f"a quarter of the device's {format_bytes(memory)}"


def device_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays in the dtypes JAX stores them in (64-bit types narrowed unless x64 is on),
    so the bytes counted are the bytes placed and a batch matches the host's exactly."""
    out = {}
    for key, value in arrays.items():
        array = np.asarray(value)
        dtype = jax.dtypes.canonicalize_dtype(array.dtype)
        out[key] = array if array.dtype == dtype else array.astype(dtype)
    return out


@functools.lru_cache(maxsize=32)
def _gather_for(
    mode: ResidentMode, batch_sharding: NamedSharding
) -> Callable[[Mapping[str, jax.Array], jax.Array], dict[str, jax.Array]]:
    def gather(arrays: Mapping[str, jax.Array], indices: jax.Array) -> dict[str, jax.Array]:
        if mode == "replicated":
            return {
                key: jax.lax.with_sharding_constraint(
                    jnp.take(value, indices, axis=0, mode="clip"), batch_sharding
                )
                for key, value in arrays.items()
            }
        return _sharded_gather(batch_sharding, dict(arrays), indices)

    return gather


def _bytes_per_row(example: Mapping[str, Any]) -> int:
    """The bytes one example takes on the devices (in the dtype JAX stores it in)."""
    return sum(
        np.size(value) * jax.dtypes.canonicalize_dtype(np.asarray(value).dtype).itemsize
        for value in example.values()
    )


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: it keys compiled programs
class ResidentData:
    """A dataset on the devices, and how a batch is gathered from it.

    Attributes:
      arrays: field name -> global array of all the examples (replicated, or rows
        split over the data axes and padded to a whole number of shards).
      mode: ``"replicated"`` or ``"sharded"``.
      batch_sharding: the sharding of a batch (rows over the data axes).
      num_examples: the examples stored (without padding).
      bytes_per_device: what the dataset takes on each device.
    """

    arrays: dict[str, jax.Array]
    mode: ResidentMode
    batch_sharding: NamedSharding
    num_examples: int
    bytes_per_device: int

    @property
    def index_sharding(self) -> NamedSharding:
        """How a step's indices are placed: like the batch (replicated layout: each
        device gathers its rows), or replicated (sharded layout: each device looks for
        every row of the batch in its part)."""
        if self.mode == "replicated":
            return self.batch_sharding
        return NamedSharding(self.batch_sharding.mesh, PartitionSpec())

    @property
    def gather(self) -> Callable[[Mapping[str, jax.Array], jax.Array], dict[str, jax.Array]]:
        """``gather(arrays, indices)``: the batch of ``indices`` (traced inside a jitted
        step; ``arrays`` is ``self.arrays`` passed as an argument, so the dataset is never
        a constant of the program). One function per layout, shared by every dataset
        placed alike, so a program built around it serves the next pipeline of the same
        shapes (a sweep's next stage, a second ``fit``) without compiling again."""
        return _gather_for(self.mode, self.batch_sharding)

    def describe(self) -> str:
        """``resident (replicated, 4.5 MiB per device)``: for a run's summary."""
        return f"resident ({self.mode}, {format_bytes(self.bytes_per_device)} per device)"


def choose_layout(
    num_examples: int,
    example: Mapping[str, Any],
    batch_sharding: NamedSharding,
    *,
    mode: ResidentMode | None = None,
    what: str = "The training data",
) -> tuple[ResidentMode, int]:
    """The layout of ``num_examples`` examples like ``example`` on the devices, and the
    bytes it takes per device.

    ``mode=None`` replicates when the dataset fits within ``resident_limit_bytes`` of
    one device, and splits its rows over the data axes when only a part fits; a
    ``mode`` asked for must fit within the same limit. Nothing is placed: a pipeline
    calls this when it is built, so a dataset that does not fit is refused before
    anything compiles.

    Raises:
      ValueError: it does not fit in the layout asked for, or (``mode=None``) in
        either; the message gives the sizes, the limit and the ways out.
    """
    shards = leading_dim_shards(batch_sharding)
    row_bytes = _bytes_per_row(example)
    sizes: dict[ResidentMode, int] = {
        "replicated": num_examples * row_bytes,
        "sharded": -(-num_examples // shards) * row_bytes,
    }
    mesh = batch_sharding.mesh
    assert isinstance(mesh, Mesh)
    limit, source = resident_limit_bytes(mesh.devices.flat[0])
    modes: tuple[ResidentMode, ...] = (
        (mode,)
        if mode is not None
        else ("replicated", "sharded")
        if shards > 1
        else ("replicated",)
    )
    for candidate in modes:
        if sizes[candidate] <= limit:
            return candidate, sizes[candidate]
    raise ValueError(_too_large(what, sizes, mode, shards=shards, limit=limit, source=source))


def place_resident(
    arrays: Mapping[str, np.ndarray],
    batch_sharding: NamedSharding,
    mode: ResidentMode,
    *,
    bytes_per_device: int,
) -> ResidentData:
    """Places ``arrays`` (one row per example) on the batch sharding's mesh in ``mode``,
    taking ``bytes_per_device`` (both from ``choose_layout``); every process passes the
    whole dataset."""
    arrays = device_arrays(arrays)
    num_examples = len(next(iter(arrays.values())))
    mesh = batch_sharding.mesh
    assert isinstance(mesh, Mesh)
    if mode == "replicated":
        sharding = NamedSharding(mesh, PartitionSpec())
        placed = {key: _place(value, sharding) for key, value in arrays.items()}
    else:
        shards = leading_dim_shards(batch_sharding)
        rows = -(-num_examples // shards) * shards
        sharding = NamedSharding(mesh, PartitionSpec(batch_sharding.spec[0]))
        padded, _ = pad_rows(arrays, rows)
        placed = {key: _place(value, sharding) for key, value in padded.items()}
    return ResidentData(placed, mode, batch_sharding, num_examples, bytes_per_device)


def read_all(
    num_examples: int,
    read: Callable[[int], Mapping[str, Any]],
    *,
    what: str,
    threads: int | None = None,
) -> dict[str, np.ndarray]:
    """Every example ``read(i)`` (``i < num_examples``), stacked field by field into
    arrays allocated once; ``threads`` (default: one per core) read at once (decoders
    release the GIL), with a progress bar on process 0 for large datasets.

    Raises:
      ValueError: an example's field has another shape than example 0's (images of
        several sizes: give the decoding transform a size).
    """
    first = {key: np.asarray(value) for key, value in read(0).items()}
    out = {key: np.empty((num_examples, *value.shape), value.dtype) for key, value in first.items()}

    def fill(lo: int, hi: int) -> int:
        for index in range(lo, hi):
            record = first if index == 0 else read(index)
            for key, array in out.items():
                value = np.asarray(record[key])
                if value.shape != array.shape[1:]:
                    raise ValueError(
                        f"{what}: example {index}'s {key!r} has shape {value.shape} but "
                        f"example 0's has {array.shape[1:]}; resident data stacks every "
                        "example, so each field needs one shape (give the decoding "
                        "transform a size, e.g. decode_transform(64))."
                    )
                array[index] = value
        return hi - lo

    chunk = 256
    spans = [(lo, min(lo + chunk, num_examples)) for lo in range(0, num_examples, chunk)]
    bar = tqdm(
        total=num_examples,
        desc="placing the dataset on the devices",
        unit="example",
        disable=num_examples < _PROGRESS_FROM or jax.process_index() != 0,
        leave=False,
    )
    workers = threads if threads is not None else os.cpu_count() or 1
    with bar, concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for done in pool.map(lambda span: fill(*span), spans):
            bar.update(done)
    return out


_PROGRESS_FROM = 20_000  # examples: smaller datasets are read in a few seconds at most


def eval_batches_bytes(
    num_steps: int,
    global_batch_size: int,
    example: Mapping[str, Any],
    batch_sharding: NamedSharding,
) -> int:
    """The bytes per device of an evaluation set placed as ``num_steps`` padded batches."""
    rows_per_device = num_steps * (global_batch_size // leading_dim_shards(batch_sharding))
    return rows_per_device * _bytes_per_row(example)


def check_eval_fits(bytes_per_device: int, batch_sharding: NamedSharding, *, what: str) -> None:
    """Raises a one-line ``ValueError`` when a resident evaluation set of
    ``bytes_per_device`` exceeds ``resident_limit_bytes``."""
    mesh = batch_sharding.mesh
    assert isinstance(mesh, Mesh)
    limit, source = resident_limit_bytes(mesh.devices.flat[0])
    if bytes_per_device > limit:
        raise ValueError(
            f"{what} needs {format_bytes(bytes_per_device)} per device to be resident (its "
            f"padded batches split over the data shards); resident data may take "
            f"{format_bytes(limit)} per device ({source}). Read the evaluation batches from "
            f"the host instead (resident=False), or set {LIMIT_VARIABLE} to the bytes per "
            "device it may take."
        )


def place_eval_batches(
    arrays: Mapping[str, np.ndarray], batch_sharding: NamedSharding, global_batch_size: int
) -> dict[str, jax.Array]:
    """``arrays`` (one row per example) zero-padded to whole global batches and placed
    as ``[steps, global_batch_size, ...]``: each batch's rows split over the data axes as
    a host batch is, so batch ``k`` is a local slice on every device."""
    arrays = device_arrays(arrays)
    num_examples = len(next(iter(arrays.values())))
    steps = -(-num_examples // global_batch_size)
    padded, _ = pad_rows(arrays, steps * global_batch_size)
    sharding = NamedSharding(batch_sharding.mesh, PartitionSpec(None, *batch_sharding.spec))
    return {
        key: _place(value.reshape(steps, global_batch_size, *value.shape[1:]), sharding)
        for key, value in padded.items()
    }


def _too_large(
    what: str,
    sizes: Mapping[ResidentMode, int],
    mode: ResidentMode | None,
    *,
    shards: int,
    limit: int,
    source: str,
) -> str:
    split = f"with its rows split over the {shards} data shards"
    if mode == "replicated":
        needs = f"{format_bytes(sizes['replicated'])} on every device to be resident replicated"
        other = f"resident='sharded' ({format_bytes(sizes['sharded'])} per device {split}), "
    elif mode == "sharded":
        needs = f"{format_bytes(sizes['sharded'])} per device to be resident {split}"
        other = ""
    else:
        needs = f"{format_bytes(sizes['replicated'])} on every device to be resident" + (
            f", or {format_bytes(sizes['sharded'])} per device {split}" if shards > 1 else ""
        )
        other = ""
    if other and sizes["sharded"] > limit:
        other = ""
    return (
        f"{what} needs {needs}; resident data may take {format_bytes(limit)} per device "
        f"({source}). Use {other}read batches from the host instead (resident=False; "
        f"--input host in the recipes), or set {LIMIT_VARIABLE} to the bytes per device it "
        "may take."
    )


def _place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the full host array every process holds (no communication)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _sharded_gather(
    batch_sharding: NamedSharding, arrays: dict[str, jax.Array], indices: jax.Array
) -> dict[str, jax.Array]:
    """Each device gathers the rows of the batch it stores, zeros elsewhere; a
    reduce-scatter over the data axes adds the parts (as unsigned integers: exact) and
    hands each device its rows."""
    mesh = batch_sharding.mesh
    axes = tuple(spec_axis_names(batch_sharding.spec[:1]))
    data_spec = PartitionSpec(batch_sharding.spec[0])

    def local(arrays: dict[str, jax.Array], indices: jax.Array) -> dict[str, jax.Array]:
        rows = next(iter(arrays.values())).shape[0]  # this device's part
        offset = indices - jax.lax.axis_index(axes) * rows
        held = (offset >= 0) & (offset < rows)
        out = {}
        for key, value in arrays.items():
            bits = _as_unsigned(value)
            taken = jnp.take(bits, jnp.clip(offset, 0, rows - 1), axis=0)
            mask = held.reshape(held.shape + (1,) * (taken.ndim - held.ndim))
            summed = jax.lax.psum_scatter(
                jnp.where(mask, taken, jnp.zeros((), taken.dtype)),
                axes,
                scatter_dimension=0,
                tiled=True,
            )
            out[key] = _from_unsigned(summed, value.dtype)
        return out

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(dict.fromkeys(arrays, data_spec), PartitionSpec()),
        out_specs=dict.fromkeys(arrays, data_spec),
        check_vma=False,
    )(arrays, indices)


def _as_unsigned(array: jax.Array) -> jax.Array:
    if array.dtype == jnp.bool_:
        return array.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(array, _UNSIGNED[array.dtype.itemsize])


def _from_unsigned(array: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return array.astype(jnp.bool_)
    return jax.lax.bitcast_convert_type(array, dtype)
