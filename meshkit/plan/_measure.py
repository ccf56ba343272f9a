"""Compile one layout's train step on stand-in devices and read what it needs per device."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
import optax

from meshkit._batch import batch_sharding
from meshkit._specs import spec_axis_names
from meshkit.models._remat import RematPolicy
from meshkit.plan._hlo import Collective, program_counts
from meshkit.plan._layout import Layout, Target, layout_mesh
from meshkit.train._gradients import LossFn
from meshkit.train._state import Model, TrainState, abstract_train_state, state_shardings_of
from meshkit.train._step import make_train_step


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is being planned: a model, its optimizer, its loss and one global batch's shapes.

    Attributes:
      model: the model, or a function from a remat policy name to the model (so a
        layout's ``remat`` reaches it, e.g. ``lambda remat: linen_model(
        Transformer(..., remat=remat), sample)``).
      tx: the optax optimizer.
      loss_fn: ``loss_fn(params, state, batch, rng) -> (loss, LossOutput)``.
      batch: the global batch, as arrays or ``jax.ShapeDtypeStruct``s (only shapes and
        dtypes are read).
      model_flops: FLOPs of one step's useful work over all devices (for MFU), from
        the architecture (``transformer_workload`` sets it: ``transformer_model_flops``);
        by default the least any candidate layout compiles to (the one that recomputes
        least), which leaves out what a fused kernel does.
    """

    model: Model | Callable[[RematPolicy], Model]
    tx: optax.GradientTransformation
    loss_fn: LossFn
    batch: Mapping[str, Any]
    model_flops: float | None = None

    def model_for(self, remat: RematPolicy) -> Model:
        """The model with ``remat`` applied (a fixed ``Model`` takes only ``"none"``)."""
        if isinstance(self.model, Model):
            if remat != "none":
                raise ValueError(
                    f"A layout asks for remat={remat!r}, but the workload's model is a fixed "
                    "Model. Pass model=lambda remat: linen_model(MyModule(remat=remat), x) "
                    "to let layouts choose."
                )
            return self.model
        return self.model(remat)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one layout's compiled train step needs, per device.

    Byte counts are per device (the largest shard where shards differ); FLOPs and
    bytes accessed are one step of one device's program, loops counted as often as
    they run. ``compiler`` says whose figures they are (XLA:CPU's temporaries are not
    a GPU's or TPU's).

    Attributes:
      layout: the layout measured.
      num_params: parameters of the model.
      params_bytes: the parameters' shard on one device.
      optimizer_bytes: the optimizer state's shard on one device.
      gradient_bytes: the gradients' shard (as the parameters').
      batch_bytes: the batch's shard.
      temp_bytes: the compiled program's temporaries.
      total_bytes: arguments + outputs - donated aliases + temporaries.
      flops: FLOPs of one step on one device.
      bytes_accessed: memory traffic as the compiler counts it (XLA:CPU counts every
        unfused elementwise operation; the TPU compiler's is the TPU's).
      matmul_bytes: operands and results of the products and convolutions alone.
      collectives: every collective, with its replica groups and run count.
      compile_seconds: time to lower and compile.
      compiler: whose figures these are (``"XLA:CPU"``, ``"XLA:TPU (v5e:16x16)"``).
      error: why the compiler gave no program for this layout (``""`` when it did):
        a refusal for memory (the TPU compiler will not compile what does not fit;
        ``temp_bytes`` is then its own requirement, ``total_bytes`` at least that plus
        the state and batch) or another failure. The figures only a program gives
        (FLOPs, traffic, collectives) are NaN or empty.
      resharding_warnings: XLA's "Involuntary full rematerialization" warnings while
        compiling (a tensor it could not reshard efficiently, replicated first; see
        docs/planning.md), taken off the console and counted here.
      compile_alarms: XLA's alarms about its own compile time while compiling
        (constant folding or a compile taking long), taken off the console and
        counted here.
      idle_axes: the layout's model and FSDP axes (of more than one device) that shard
        no parameter: a model axis then only repeats the same work on each of its
        devices, an FSDP axis is plain data parallelism.
    """

    layout: Layout
    num_params: int
    params_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    batch_bytes: int
    temp_bytes: int
    total_bytes: int
    flops: float
    bytes_accessed: float
    matmul_bytes: float
    collectives: tuple[Collective, ...]
    compile_seconds: float
    compiler: str
    error: str = ""
    idle_axes: tuple[str, ...] = ()
    resharding_warnings: int = 0
    compile_alarms: int = 0

    def traffic_bytes(self, *, across_slices: bool | None = None) -> float:
        """Bytes one device sends per step in collectives (all, within, or across slices)."""
        return sum(
            c.traffic_bytes * c.count
            for c in self.collectives
            if across_slices is None or c.across_slices == across_slices
        )


def shard_bytes(tree: Any) -> int:
    """Bytes the largest device holds of ``tree``'s ``ShapeDtypeStruct``s with shardings."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        size = int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        for device in leaf.sharding.device_set:
            per_device[device] = per_device.get(device, 0) + size
    return max(per_device.values(), default=0)


def _batch_specs(batch: Mapping[str, Any], sharding: Any) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        key: jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=sharding)
        for key, value in batch.items()
    }


def measure(
    workload: Workload, layout: Layout, target: Target, devices: Sequence[Any]
) -> Measurement:
    """Lowers and compiles ``layout``'s train step on abstract inputs; allocates no state."""
    mesh, slice_of_device = layout_mesh(layout, devices, target.slices)
    model = workload.model_for(layout.remat)
    state = abstract_train_state(
        model, workload.tx, precision=layout.precision, mesh=mesh, rules=layout.rules
    )
    data = batch_sharding(mesh, layout.data_axes)
    shards = math.prod(mesh.shape[axis] for axis in layout.data_axes)
    rows = {key: np.shape(value)[0] for key, value in workload.batch.items() if np.ndim(value)}
    uneven = {key: n for key, n in rows.items() if n % shards}
    if uneven:  # this layout cannot take the batch; others may
        reason = (
            f"the global batch ({', '.join(f'{k}: {n} rows' for k, n in uneven.items())}) does "
            f"not split over its {shards} data shards ({' x '.join(layout.data_axes)}); use a "
            f"batch that is a multiple of {shards}"
        )
        return _refused(reason, state, _batch_specs(workload.batch, None), layout, target=target)
    batch = _batch_specs(workload.batch, data)
    step = make_train_step(
        workload.loss_fn, state_shardings_of(state), data, microbatches=layout.microbatches
    )
    start = time.perf_counter()
    log = XlaLog()
    with _xla_log(log):
        measurement = _compile(
            step, state, batch, layout, slice_of_device=slice_of_device, target=target, start=start
        )
    return dataclasses.replace(
        measurement, resharding_warnings=log.reshards, compile_alarms=log.alarms
    )


def _compile(
    step: Any,
    state: TrainState,
    batch: dict[str, jax.ShapeDtypeStruct],
    layout: Layout,
    *,
    slice_of_device: list[int],
    target: Target,
    start: float,
) -> Measurement:
    """Lowers and compiles the step; a compile that fails is the layout's row."""
    try:
        lowered = cast(Any, step).lower(state, batch)
    except Exception as error:
        shapes = {key: (spec.shape, str(spec.dtype)) for key, spec in batch.items()}
        raise ValueError(
            f"Layout {layout.name!r}: the train step could not be traced with the batch "
            f"{shapes} ({type(error).__name__}: {error}). Check the workload's batch shapes "
            "against what its model and loss expect."
        ) from error
    try:
        compiled = lowered.compile()
    except Exception as error:  # one layout's failure is its row, not the plan's end
        seconds = time.perf_counter() - start
        reason, temp = _compile_failure(error, target)
        return _refused(reason, state, batch, layout, target=target, temp=temp, seconds=seconds)
    seconds = time.perf_counter() - start
    return _read(compiled, state, batch, layout, slice_of_device, seconds=seconds, target=target)


_MEMORY_REFUSAL = re.compile(
    r"required for (?P<what>[\w ]+?) \((?P<need>[\d.]+)(?P<unit>[KMGT]?)\) exceeds "
    r"available \w+ \((?P<have>[\d.]+)(?P<have_unit>[KMGT]?)\)"
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_refusal(message: str) -> tuple[str, int, int] | None:
    """``(what, bytes needed, bytes available)`` from a compiler's out-of-memory refusal
    (XLA prints binary units: ``18.82G`` is GiB), or ``None`` for another message.

    Examples:
        >>> memory_refusal("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        ...     "required for HLO temporaries (18.82G) exceeds available HBM (15.75G).")
        ('HLO temporaries', 20207821127, 16911433728)
    """
    match = _MEMORY_REFUSAL.search(message)
    if match is None:
        return None
    need = float(match["need"]) * _UNITS[match["unit"]]
    have = float(match["have"]) * _UNITS[match["have_unit"]]
    return match["what"], int(need), int(have)


RESHARDING_WARNING = "Involuntary full rematerialization"
"""What XLA's SPMD partitioner logs when it replicates a tensor to reshard it."""

COMPILE_ALARM = "slow_operation_alarm"
"""The source file of XLA's alarms about its own compile time ("Constant folding an
instruction is taking > 1s", "Very slow compile?"): a paragraph each, about the compile,
not the program."""

_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")
"""The start of one of XLA's C++ log lines (severity and date); an alarm's paragraph
runs until the next."""


@dataclasses.dataclass
class XlaLog:
    """XLA's C++ log lines while a layout compiled: resharding warnings and compile-time
    alarms counted, the rest passed on."""

    reshards: int = 0
    alarms: int = 0


@contextlib.contextmanager
def _xla_log(log: XlaLog) -> Iterator[None]:
    """XLA's C++ log lines (file descriptor 2) while the block runs: those naming
    ``RESHARDING_WARNING`` and the ``COMPILE_ALARM`` paragraphs are counted in ``log``,
    the rest go back to stderr after it (so nothing lands inside a progress bar)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
    in_alarm = False
    for line in text.splitlines(keepends=True):
        if _LOG_LINE.match(line):
            in_alarm = False
        if RESHARDING_WARNING in line:
            log.reshards += 1
        elif COMPILE_ALARM in line:
            log.alarms += 1
            in_alarm = True
        elif not in_alarm:
            sys.stderr.write(line)
    sys.stderr.flush()


def _compile_failure(error: Exception, target: Target) -> tuple[str, int]:
    """One line on why the compiler gave no program (its memory refusal, or its error),
    and the temporaries a memory refusal names (else 0)."""
    compiler = _compiler_name(target)
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    refusal = memory_refusal(message)
    if refusal is None:
        return f"{compiler} could not compile it: {type(error).__name__}: {message}", 0
    what, need, have = refusal
    reason = (
        f"{compiler} refused it for memory: {what} need {need / 2**30:.2f} GiB, "
        f"{have / 2**30:.2f} GiB available"
    )
    return reason, need if "temporar" in what.lower() else 0


def _refused(
    reason: str,
    state: TrainState,
    batch: dict[str, jax.ShapeDtypeStruct],
    layout: Layout,
    *,
    target: Target,
    temp: int = 0,
    seconds: float = 0.0,
) -> Measurement:
    """The figures known without a program (``temp``: a memory refusal's temporaries),
    and ``reason`` there is none."""
    params_bytes = shard_bytes(state.params)
    optimizer_bytes = shard_bytes(state.opt_state)
    batch_bytes = shard_bytes(batch) if all(leaf.sharding for leaf in batch.values()) else 0
    nan = float("nan")
    return Measurement(
        layout=layout,
        num_params=sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state.params)),
        params_bytes=params_bytes,
        optimizer_bytes=optimizer_bytes,
        gradient_bytes=params_bytes,
        batch_bytes=batch_bytes,
        temp_bytes=temp,
        total_bytes=params_bytes + optimizer_bytes + batch_bytes + temp,
        flops=nan,
        bytes_accessed=nan,
        matmul_bytes=nan,
        collectives=(),
        compile_seconds=seconds,
        compiler=_compiler_name(target),
        error=reason,
        idle_axes=idle_axes(state, layout),
    )


def _compiler_name(target: Target) -> str:
    if target.compiler == "tpu":
        return f"XLA:TPU ({target.topology})"
    return "XLA:GPU (compile-only)" if target.compiler == "gpu" else "XLA:CPU"


def idle_axes(state: TrainState, layout: Layout) -> tuple[str, ...]:
    """The layout's model axes and FSDP axes (data axes after the first) of more than
    one device that no parameter is sharded over."""
    used = {
        axis
        for leaf in jax.tree.leaves(state.params)
        for axis in spec_axis_names(getattr(leaf.sharding, "spec", ()))
    }
    sharding_axes = [
        axis
        for axis, size in layout.axis_sizes.items()
        if size > 1 and (axis not in layout.data_axes or axis != layout.data_axes[0])
    ]
    return tuple(axis for axis in sharding_axes if axis not in used)


def _read(
    compiled: Any,
    state: TrainState,
    batch: dict[str, jax.ShapeDtypeStruct],
    layout: Layout,
    slice_of_device: list[int],
    *,
    seconds: float,
    target: Target,
) -> Measurement:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    counts = program_counts(compiled.as_text(), slice_of_device)
    raw_flops = float(cost.get("flops", 0.0))
    if raw_flops > 0:
        flops = raw_flops + counts.dot_flops - counts.dot_flops_once  # loop bodies, all trips
    else:  # no cost analysis (XLA:GPU without a GPU): the products, every trip
        flops = counts.dot_flops
    scale = flops / raw_flops if raw_flops > 0 else 1.0  # for the bytes: loops' trips
    flops += counts.kernel_flops  # attention kernels, which XLA cannot see into
    params_bytes = shard_bytes(state.params)
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    return Measurement(
        layout=layout,
        num_params=sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state.params)),
        params_bytes=params_bytes,
        optimizer_bytes=shard_bytes(state.opt_state),
        gradient_bytes=params_bytes,
        batch_bytes=shard_bytes(batch),
        temp_bytes=int(memory.temp_size_in_bytes),
        total_bytes=int(total),
        flops=flops,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) * scale,
        matmul_bytes=counts.dot_bytes,
        collectives=counts.collectives,
        compile_seconds=seconds,
        compiler=_compiler_name(target),
        idle_axes=idle_axes(state, layout),
    )
