"""A candidate layout, the hardware it is planned for, and the devices that stand in for it."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from meshkit._mesh import parse_axes
from meshkit._rules import FSDP, PartitionRules, Rule
from meshkit.models._remat import RematPolicy
from meshkit.plan._accelerators import Accelerator, accelerator
from meshkit.plan._efficiency import Efficiency, calibrated

Compiler = Literal["cpu", "tpu", "gpu"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to lay a training job out: the mesh, the rules, remat, micro-batches, dtypes.

    Attributes:
      axes: mesh axis sizes in mesh order, ``{"data": 8, "fsdp": 4, "model": 2}`` (or
        ``"data=8,fsdp=4,model=2"``); they must multiply to the target's device count.
      rules: how the train state is sharded (``None``: replicated, pure data parallel).
      data_axes: the mesh axes the batch is split over.
      remat: the rematerialisation policy handed to the model (``"none"``,
        ``"dots_saveable"``, ``"nothing_saveable"``, ...; see ``meshkit.models``).
      microbatches: gradient accumulation steps per update.
      precision: the compute dtype policy (``"f32"``, ``"bf16"``, ``"f16"``);
        parameters and optimizer state stay float32.
      dcn_axes: with several slices, how many slices each axis spans
        (default: all slices on the first data axis).
      name: a short label; built from the fields when empty.
    """

    axes: Mapping[str, int] | str
    rules: PartitionRules | None = None
    data_axes: tuple[str, ...] = ("data",)
    remat: RematPolicy = "none"
    microbatches: int = 1
    precision: str = "bf16"
    dcn_axes: Mapping[str, int] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        axes = parse_axes(self.axes) if isinstance(self.axes, str) else dict(self.axes)
        for axis, size in axes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"Layout axes {axes} give axis {axis!r} size {size!r}; every size must be "
                    "a positive int (no -1 in a plan: say how many devices each axis takes)."
                )
        missing = [axis for axis in self.data_axes if axis not in axes]
        if missing:
            raise ValueError(
                f"Layout data_axes {self.data_axes} names {missing}, which are not among its "
                f"axes {axes}. Add the axis or name one of {list(axes)}."
            )
        object.__setattr__(self, "axes", axes)
        if not self.name:
            shape = ",".join(f"{axis}={size}" for axis, size in axes.items())
            extra = "" if self.remat == "none" else f" remat={self.remat}"
            extra += "" if self.microbatches == 1 else f" mb={self.microbatches}"
            object.__setattr__(self, "name", f"{shape}{extra}")

    def to_json(self) -> dict[str, Any]:
        """The layout as plain JSON values; ``Layout.from_json`` reads it back."""
        rules = self.rules
        return {
            "name": self.name,
            "axes": self.axis_sizes,
            "data_axes": list(self.data_axes),
            "remat": self.remat,
            "microbatches": self.microbatches,
            "precision": self.precision,
            "dcn_axes": dict(self.dcn_axes) if self.dcn_axes else None,
            "logical": None if rules is None or rules.logical is None else rules.logical,
            "default": None if rules is None else _rule_json(rules.default),
            "regex_rules": []
            if rules is None
            else [[pattern, _rule_json(rule)] for pattern, rule in rules.rules],
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Layout:
        """A layout from ``to_json``'s values (a plan's JSON holds one per candidate)."""
        rules = None
        if record.get("default") is not None:
            rules = PartitionRules(
                [(pattern, _rule_from_json(rule)) for pattern, rule in record["regex_rules"]],
                logical=[(name, axes) for name, axes in record["logical"] or ()] or None,
                default=_rule_from_json(record["default"]),
            )
        return cls(
            axes=dict(record["axes"]),
            rules=rules,
            data_axes=tuple(record["data_axes"]),
            remat=record["remat"],
            microbatches=int(record["microbatches"]),
            precision=record["precision"],
            dcn_axes=record.get("dcn_axes"),
            name=record["name"],
        )

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """The layout's mesh over real devices (default ``jax.devices()``), for training.

        Examples:
            >>> dict(Layout("data=1,model=1").make_mesh(jax.devices()[:1]).shape)
            {'data': 1, 'model': 1}
        """
        from meshkit._mesh import make_mesh

        return make_mesh(self.axis_sizes, dcn_axes=self.dcn_axes, devices=devices)

    def scaled_to(self, devices: int) -> Layout | None:
        """The same layout on ``devices`` devices: the model (tensor) axes kept, the data
        axes resized (the FSDP axis keeps what it can divide), or ``None`` where the model
        axes do not divide ``devices``. The rules, remat, micro-batches and precision
        stay; slices are not kept.

        Examples:
            >>> Layout("data=8,fsdp=8,model=1", data_axes=("data", "fsdp")).scaled_to(8).name
            'data=1,fsdp=8,model=1'
            >>> Layout("data=8,model=8").scaled_to(4) is None
            True
        """
        sizes = self.axis_sizes
        model = math.prod(size for axis, size in sizes.items() if axis not in self.data_axes)
        if devices % model:
            return None
        left = devices // model
        scaled = dict(sizes)
        for axis in reversed(self.data_axes):  # the innermost data axis (fsdp) first
            scaled[axis] = math.gcd(sizes[axis], left) if axis != self.data_axes[0] else left
            left //= scaled[axis]
        return dataclasses.replace(self, axes=scaled, dcn_axes=None, name="")

    @property
    def axis_sizes(self) -> dict[str, int]:
        """The mesh axis sizes, in mesh order."""
        assert isinstance(self.axes, dict)
        return dict(self.axes)

    @property
    def num_devices(self) -> int:
        """Devices the layout's mesh holds."""
        return math.prod(self.axis_sizes.values())


def _rule_json(rule: Rule) -> dict[str, Any]:
    if isinstance(rule, FSDP):
        return {"fsdp": rule.axis, "min_size": rule.min_size}
    return {"spec": [list(e) if isinstance(e, tuple) else e for e in rule]}


def _rule_from_json(record: Mapping[str, Any]) -> Rule:
    if "fsdp" in record:
        axis = record["fsdp"]
        return FSDP(tuple(axis) if isinstance(axis, list) else axis, record["min_size"])
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in record["spec"]])


@dataclasses.dataclass(frozen=True)
class Target:
    """The hardware a plan is for: an accelerator, how many, in how many slices.

    Attributes:
      accelerator: the accelerator's name in ``ACCELERATORS`` (``"h100"``, ``"v5e"``, ...).
      devices: the total number of chips.
      slices: slices (TPU) or nodes (GPU) the chips are in; collectives whose groups
        span slices use the slower network between them.
      compiler: ``"cpu"`` compiles for fake CPU devices (always available; memory and
        FLOP figures are XLA:CPU's), ``"tpu"`` for a TPU topology description with the
        TPU compiler (needs ``pip install "meshkit[tpu]"``; figures are the TPU's own),
        ``"gpu"`` for compile-only NVIDIA GPUs with XLA:GPU (``h100``, ``h200``,
        ``a100``; needs ``pip install "meshkit[gpu-plan]"``, no GPU; memory figures are
        XLA:GPU's, FLOPs counted from the program's products).
      topology: the TPU topology name, e.g. ``"v5e:16x16"`` (``compiler="tpu"`` only).
      memory_fraction: the share of each chip's memory a plan may use; by default
        what a program gets (``Accelerator.usable_bytes``: JAX's preallocation on a
        GPU, XLA:TPU's own limit on a TPU).
      efficiency: the fractions of the chip's peaks a step reaches; by default the
        chip family's calibration on published measured runs
        (``step_efficiency``; docs/planning.md lists the runs).
    """

    accelerator: str
    devices: int
    slices: int = 1
    compiler: Compiler = "cpu"
    topology: str | None = None
    memory_fraction: float | None = None
    efficiency: Efficiency | None = None

    def __post_init__(self) -> None:
        accelerator(self.accelerator)  # an unknown name fails here, listing the known ones
        if self.devices < 1 or self.slices < 1 or self.devices % self.slices:
            raise ValueError(
                f"Target devices={self.devices} in slices={self.slices}: both must be "
                "positive and the slices must divide the devices evenly."
            )
        if self.compiler not in ("cpu", "tpu", "gpu"):
            raise ValueError(
                f"Target compiler must be 'cpu', 'tpu' or 'gpu', got {self.compiler!r}."
            )
        if self.compiler == "tpu" and not self.topology:
            raise ValueError(
                "Target compiler='tpu' needs a topology name, e.g. topology='v5e:16x16'."
            )

    @property
    def chip(self) -> Accelerator:
        """The accelerator's published figures."""
        return accelerator(self.accelerator)

    def usable_bytes(self) -> tuple[int, str]:
        """The memory a program may use on one chip, and why (``memory_fraction``)."""
        return self.chip.usable_bytes(self.memory_fraction)

    def step_efficiency(self) -> Efficiency:
        """``efficiency``, or the chip family's calibrated one."""
        if self.efficiency is not None:
            return self.efficiency
        return calibrated(self.chip.family)


XLA_CPU_MAX_DEVICES = 2048
"""The most devices one XLA:CPU program may span (2049 fails to compile, jax 0.10.2)."""


def installed_compilers() -> tuple[str, ...]:
    """The compilers a :class:`Target` can name on this machine: ``"cpu"`` always,
    ``"tpu"`` where libtpu is installed (``meshkit[tpu]``), ``"gpu"`` where JAX's CUDA
    plugin is (``meshkit[gpu-plan]``); neither needs the chips themselves.

    Examples:
        >>> installed_compilers()[0]
        'cpu'
    """
    from meshkit._plugins import cuda_plugin_installed, libtpu_installed

    return ("cpu", *("tpu",) * libtpu_installed(), *("gpu",) * cuda_plugin_installed())


def target_devices(target: Target) -> list[Any]:
    """Devices that stand in for the target's chips, in slice order.

    With ``compiler="cpu"`` these are this process's CPU devices (start it with enough:
    ``jax.config.update("jax_num_cpu_devices", n)`` before JAX starts, or run
    ``python -m meshkit.plan``, which does so in a child process); with ``"tpu"``, the
    devices of the TPU topology description, which need no TPU to compile for.
    """
    if target.compiler == "tpu":
        return _tpu_devices(target)
    if target.compiler == "gpu":
        from meshkit.plan._cuda import gpu_devices

        return gpu_devices(target.accelerator, target.devices, target.slices)
    if target.devices > XLA_CPU_MAX_DEVICES:
        raise ValueError(
            f"XLA:CPU compiles for at most {XLA_CPU_MAX_DEVICES} devices (above that it "
            f'says "Multiprocess computations aren\'t implemented"), and the target has '
            f"{target.devices}. Plan with the TPU compiler (--compiler tpu --topology ..., "
            f'pip install "meshkit[tpu]"), or plan {XLA_CPU_MAX_DEVICES} or fewer devices '
            "and scale the chosen layout up (Layout.scaled_to; recipes.transformer_lm "
            "--scale-to-devices)."
        )
    devices = jax.devices("cpu")
    if len(devices) < target.devices:
        raise RuntimeError(
            f"Planning for {target.devices} devices needs {target.devices} fake CPU devices, "
            f"but this process has {len(devices)}. Plan from `python -m meshkit.plan` "
            "(it starts a process with enough), or call "
            f"jax.config.update('jax_num_cpu_devices', {target.devices}) before JAX starts."
        )
    return devices[: target.devices]


def _tpu_devices(target: Target) -> list[Any]:
    try:
        from jax.experimental import topologies
    except ImportError as error:  # pragma: no cover - part of jax
        raise ImportError("jax.experimental.topologies is missing from this jax.") from error
    try:
        topology = topologies.get_topology_desc(
            topology_name=str(target.topology), platform="tpu", num_slices=target.slices
        )
    except Exception as error:
        raise RuntimeError(
            f"Could not describe TPU topology {target.topology!r} ({error}). The TPU "
            'compiler comes with libtpu: pip install "meshkit[tpu]" (jax[tpu] at the '
            "installed jax version); or plan with compiler='cpu' (--compiler cpu)."
        ) from error
    devices = sorted(topology.devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))
    if len(devices) != target.devices:
        raise ValueError(
            f"TPU topology {target.topology!r} x {target.slices} slices has {len(devices)} "
            f"chips, but the target says devices={target.devices} (--devices). Make them "
            "agree."
        )
    return devices


def layout_mesh(layout: Layout, devices: Sequence[Any], slices: int) -> tuple[Mesh, list[int]]:
    """The layout's mesh over ``devices``, whose consecutive blocks are the ``slices``.

    Axes named in ``dcn_axes`` span slices (outer), the rest of each axis stays within
    a slice, as ``mesh_utils.create_hybrid_device_mesh`` arranges real multi-slice jobs.
    Also returns the slice of each device of the mesh, in the mesh's flat order (the
    device ids a compiled program's replica groups name).
    """
    sizes = layout.axis_sizes
    if layout.num_devices != len(devices):
        raise ValueError(
            f"Layout {layout.name!r} has axes {sizes}, which multiply to "
            f"{layout.num_devices} devices, but the target has {len(devices)}. Choose axis "
            f"sizes whose product is {len(devices)}."
        )
    dcn = _dcn_sizes(layout, slices)
    ici = {axis: size // dcn[axis] for axis, size in sizes.items()}
    # ids[dcn coords..., ici coords...] = slice * per_slice + position within the slice
    ids = np.arange(len(devices)).reshape(*dcn.values(), *ici.values())
    n = len(sizes)
    order = [axis for pair in zip(range(n), range(n, 2 * n), strict=True) for axis in pair]
    grid = ids.transpose(order).reshape(tuple(sizes.values()))
    device_array = np.asarray(devices, dtype=object)[grid]
    mesh = Mesh(device_array, tuple(sizes), axis_types=(AxisType.Auto,) * n)
    per_slice = len(devices) // slices
    slice_of = [getattr(devices[int(position)], "slice_index", None) for position in grid.flat]
    known = all(index is not None for index in slice_of)
    if slices > 1 and known and len(set(slice_of)) == slices:  # a TPU topology says
        return mesh, [int(index) for index in slice_of]  # pyright: ignore[reportArgumentType]
    # GPUs: one partition of several hosts (every slice_index 0); nodes are id blocks
    return mesh, [int(position) // per_slice for position in grid.flat]


def _dcn_sizes(layout: Layout, slices: int) -> dict[str, int]:
    sizes = layout.axis_sizes
    dcn = dict.fromkeys(sizes, 1)
    if slices == 1:
        return dcn
    wanted = dict(layout.dcn_axes or {layout.data_axes[0]: slices})
    dcn.update(wanted)
    if math.prod(dcn.values()) != slices or any(sizes[a] % dcn[a] for a in sizes):
        raise ValueError(
            f"Layout {layout.name!r} spreads {dcn} slices over axes {sizes}, but the target "
            f"has {slices} slices: dcn_axes must multiply to {slices} and divide their axes."
        )
    return dcn


def load_layout(path: str | Path, name: str | None = None) -> Layout:
    """A layout from a plan's JSON (``python -m meshkit.plan --json PATH``).

    Without ``name``, the plan's choice: its first layout, if it fits. Raises a
    ``ValueError`` naming the layouts in the file when ``name`` is not among them, or
    when none fits.
    """
    records = json.loads(Path(path).read_text())["layouts"]
    if name is None:
        fitting = [record for record in records if record["fits"]]
        if not fitting:
            raise ValueError(
                f"No layout in {path} fits its target; pick one by name (one of "
                f"{[record['layout'] for record in records]}) or plan again."
            )
        return Layout.from_json(fitting[0]["layout_spec"])
    for record in records:
        if record["layout"] == name:
            return Layout.from_json(record["layout_spec"])
    raise ValueError(
        f"No layout named {name!r} in {path}; it has {[record['layout'] for record in records]}."
    )
