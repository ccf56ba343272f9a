"""Device meshes with named axes: parsing, validation and topology routing."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshkit._checks import check_int

AxesLike = Mapping[str, int] | str
"""Mesh axes as ``{"data": -1, "model": 2}`` or as the string ``"data=-1,model=2"``."""

AxisTypesLike = AxisType | Mapping[str, AxisType]

DEFAULT_AXIS_TYPE = AxisType.Auto
"""meshkit's default axis type.

``Auto`` leaves sharding propagation inside a jit to the compiler, which is what
flax linen modules and jaxopt solvers are written for: both run unchanged on an
``Auto`` mesh. ``Explicit`` axes make shardings part of every array's type; pass
``axis_types=AxisType.Explicit`` when you want that, and run your jitted code under
``jax.set_mesh(mesh)``.
"""

DATA_AXIS = "data"
"""The mesh axis batch rows are split over unless a caller names another (``data_axis=``).

Every meshkit default that means "the data axis" is this name: ``batch_sharding``,
the evaluation entry points, ``FSDP``, ``EnsembleLayout``, the L-BFGS data.
"""

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_axes(axes: AxesLike) -> dict[str, int]:
    """Parses mesh axes from a mapping or a ``"name=size,..."`` string.

    Sizes are positive integers; at most one axis may be ``-1``, meaning "fill with
    the devices that are left". The order of the axes is kept: it is the order of the
    mesh's dimensions.

    Examples:
        >>> parse_axes("data=-1,ensemble=2")
        {'data': -1, 'ensemble': 2}
        >>> parse_axes({"data": 4})
        {'data': 4}
    """
    if isinstance(axes, str):
        parsed: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in axes.split(","))):
            name, sep, size = item.partition("=")
            name = name.strip()
            if not sep or not re.fullmatch(r"\s*-?\d+\s*", size):
                raise ValueError(
                    f"Cannot parse mesh axis {item!r} in {axes!r}: expected "
                    "'name=size' items separated by commas, e.g. 'data=-1,model=2'."
                )
            if name in parsed:
                raise ValueError(
                    f"Mesh axis {name!r} appears twice in {axes!r}; name each axis once."
                )
            parsed[name] = int(size)
        axes = parsed
    elif not isinstance(axes, Mapping):
        raise TypeError(
            f"Mesh axes must be a mapping like {{'data': -1}} or a string like 'data=-1', "
            f"got {type(axes).__name__}: {axes!r}."
        )
    if not axes:
        raise ValueError(
            "A mesh needs at least one axis, got none. Example: make_mesh({'data': -1})."
        )
    result: dict[str, int] = {}
    for name, size in axes.items():
        if not isinstance(name, str) or not _AXIS_NAME.match(name):
            raise ValueError(
                f"Mesh axis name {name!r} is not a valid identifier; use names like 'data'."
            )
        check_int(
            size,
            name=f"Mesh axis {name!r} size",
            fix="Pass a positive int, or -1 to fill with the remaining devices.",
        )
        if size == 0 or size < -1:
            raise ValueError(
                f"Mesh axis {name!r} has size {size}; expected a positive int, or -1 to fill "
                "with the remaining devices."
            )
        result[name] = int(size)
    filled = [name for name, size in result.items() if size == -1]
    if len(filled) > 1:
        raise ValueError(
            f"At most one mesh axis may be -1, got {len(filled)}: {filled} in {result}. "
            "Give all but one of them explicit sizes."
        )
    return result


def resolve_axis_sizes(axes: AxesLike, num_devices: int) -> dict[str, int]:
    """Fills a ``-1`` axis from ``num_devices`` and checks that the product matches.

    Examples:
        >>> resolve_axis_sizes("data=-1,model=2", 8)
        {'data': 4, 'model': 2}
    """
    parsed = parse_axes(axes)
    known = math.prod(size for size in parsed.values() if size != -1)
    if -1 in parsed.values():
        if num_devices % known:
            raise ValueError(
                f"Cannot fill the -1 axis of {parsed}: the other axes multiply to {known}, "
                f"which does not divide the {num_devices} devices. Choose sizes whose product "
                f"divides {num_devices}."
            )
        return {
            name: (num_devices // known if size == -1 else size) for name, size in parsed.items()
        }
    if known != num_devices:
        raise ValueError(
            f"Mesh axes {parsed} multiply to {known} devices, but {num_devices} devices are "
            f"available. Make the product equal {num_devices}, or use -1 for one axis "
            "(e.g. 'data=-1') to fill it automatically."
        )
    return parsed


def _num_slices(devices: Sequence[Any]) -> int:
    return len({getattr(device, "slice_index", 0) for device in devices})


def _resolve_dcn_axes(
    sizes: Mapping[str, int], dcn_axes: AxesLike | None, num_slices: int
) -> dict[str, int]:
    """Returns how many slices each axis spans (1 for axes that stay inside a slice)."""
    if dcn_axes is None:
        if num_slices == 1:
            return dict.fromkeys(sizes, 1)
        if DATA_AXIS in sizes and sizes[DATA_AXIS] % num_slices == 0:
            return {name: (num_slices if name == DATA_AXIS else 1) for name in sizes}
        raise ValueError(
            f"The devices span {num_slices} slices, so the mesh needs dcn_axes saying which "
            f"axes cross slices; mesh axes are {dict(sizes)}. Pass e.g. "
            f"dcn_axes={{'{DATA_AXIS}': {num_slices}}}."
        )
    parsed = parse_axes(dcn_axes)
    if num_slices == 1 and any(size != 1 for size in parsed.values()):
        raise ValueError(
            f"dcn_axes={parsed} spreads the mesh over several slices, but all devices are "
            "in one slice. Drop dcn_axes."
        )
    unknown = sorted(set(parsed) - set(sizes))
    if unknown:
        raise ValueError(
            f"dcn_axes names {unknown}, which are not mesh axes {list(sizes)}. "
            "Name only axes of the mesh."
        )
    dcn = resolve_axis_sizes({name: parsed.get(name, 1) for name in sizes}, num_slices)
    for name, size in sizes.items():
        if size % dcn[name]:
            raise ValueError(
                f"Mesh axis {name!r} has size {size} but dcn_axes asks it to span {dcn[name]} "
                f"slices; {dcn[name]} must divide {size}."
            )
    return dcn


def device_grid(
    sizes: Mapping[str, int],
    devices: Sequence[Any],
    dcn_axes: AxesLike | None = None,
) -> np.ndarray:
    """Arranges ``devices`` into an array of shape ``sizes.values()``.

    Devices in one slice go through ``mesh_utils.create_device_mesh``, which knows
    TPU torus layouts. Devices spanning several slices (several TPU slices, or the
    hosts of a multi-node GPU job) go through ``mesh_utils.create_hybrid_device_mesh``:
    each axis of size ``n`` that spans ``k`` slices becomes ``n // k`` devices within a
    slice times ``k`` slices, so that only the axes named in ``dcn_axes`` cross the slower
    data-centre network.

    Examples:
        >>> import jax
        >>> device_grid({"data": 1}, jax.devices()[:1]).shape
        (1,)
    """
    shape = tuple(sizes.values())
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"Mesh axes {dict(sizes)} need {math.prod(shape)} devices, got {len(devices)}."
        )
    num_slices = _num_slices(devices)
    dcn = _resolve_dcn_axes(sizes, dcn_axes, num_slices)
    if num_slices == 1:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    ici_shape = tuple(size // dcn[name] for name, size in sizes.items())
    return mesh_utils.create_hybrid_device_mesh(
        ici_shape, tuple(dcn.values()), devices, allow_split_physical_axes=True
    )


def _resolve_axis_types(names: Sequence[str], axis_types: AxisTypesLike) -> tuple[AxisType, ...]:
    if isinstance(axis_types, AxisType):
        return (axis_types,) * len(names)
    if isinstance(axis_types, Mapping):
        unknown = sorted(set(axis_types) - set(names))
        if unknown:
            raise ValueError(f"axis_types names {unknown}, which are not mesh axes {list(names)}.")
        return tuple(axis_types.get(name, DEFAULT_AXIS_TYPE) for name in names)
    raise TypeError(
        f"axis_types must be a jax.sharding.AxisType or a mapping from axis name to "
        f"AxisType, got {axis_types!r}."
    )


def _check_devices(devices: Sequence[Any]) -> list[Any]:
    """``devices`` as a list; raises for none, or for a device listed twice."""
    devices = list(devices)
    if not devices:
        raise ValueError(
            "make_mesh got devices=[] (no devices). Pass some devices, e.g. "
            "jax.devices()[:4], or leave devices out to use all of them."
        )
    seen: set[Any] = set()
    for device in devices:
        if device in seen:
            raise ValueError(
                f"make_mesh got device {device} twice in devices={devices}; a mesh holds "
                "each device once. Pass distinct devices, e.g. jax.devices()[:n]."
            )
        seen.add(device)
    return devices


def make_mesh(
    axes: AxesLike,
    *,
    dcn_axes: AxesLike | None = None,
    axis_types: AxisTypesLike = DEFAULT_AXIS_TYPE,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds a device mesh with named axes.

    Args:
      axes: axis names and sizes, in mesh order: ``{"data": -1, "ensemble": 2}`` or
        ``"data=-1,ensemble=2"``. One axis may be ``-1`` to take the remaining devices.
      dcn_axes: for devices spanning several slices (multi-slice TPU pods, multi-node
        GPU jobs), how many slices each axis spans, e.g. ``{"data": 2}``. Defaults to
        putting all slices on the ``data`` axis (``DATA_AXIS``).
      axis_types: one ``jax.sharding.AxisType`` for all axes, or a mapping per axis.
        Defaults to ``AxisType.Auto`` (see ``DEFAULT_AXIS_TYPE``); it is always passed
        explicitly to JAX.
      devices: the devices to use; defaults to ``jax.devices()``.

    Returns:
      A ``jax.sharding.Mesh``.

    Examples:
        >>> import meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> mesh.axis_names
        ('data',)
    """
    devices = _check_devices(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(axes, len(devices))
    types = _resolve_axis_types(tuple(sizes), axis_types)
    grid = device_grid(sizes, devices, dcn_axes)
    return Mesh(grid, tuple(sizes), axis_types=types)


def check_axis_names(mesh: Mesh, names: Sequence[str], *, what: str) -> None:
    """Raises a ``ValueError`` naming any of ``names`` that are not axes of ``mesh``."""
    unknown = [name for name in names if name not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"Unknown mesh axis {unknown[0]!r} in {what}; the mesh has axes "
            f"{dict(mesh.shape)}. Use one of {list(mesh.axis_names)} or add the axis to the mesh."
        )


def check_data_axis(mesh: Any, data_axis: str, *, where: str) -> Mesh:
    """Returns ``mesh``; raises a clear error unless it is a ``Mesh`` with an axis ``data_axis``.

    ``where`` names the caller in the message (``"full_eval"``).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where} needs a jax.sharding.Mesh, got {type(mesh).__name__}: {mesh!r}. Build "
            f"one with meshkit.make_mesh('{DATA_AXIS}=-1')."
        )
    if not isinstance(data_axis, str) or data_axis not in mesh.axis_names:
        raise ValueError(
            f"{where} got data_axis={data_axis!r}, but the mesh has axes {dict(mesh.shape)} "
            f"and none is named {data_axis!r}, so there is no axis to split the rows over. "
            f"Pass data_axis=<one of {list(mesh.axis_names)}>, or build the mesh with that "
            f"axis, e.g. meshkit.make_mesh('{data_axis}=-1')."
        )
    return mesh
