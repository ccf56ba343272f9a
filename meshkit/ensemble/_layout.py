"""Where an ensemble's members and its batches live on the mesh."""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._checks import check_int
from meshkit._mesh import DATA_AXIS

ENSEMBLE_AXIS = "ensemble"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_num_members(num_members: object) -> int:
    return check_int(
        num_members,
        name="num_members (the ensemble size K)",
        minimum=1,
        fix="An ensemble needs at least 1 member.",
    )


def _check_axes(mesh: Mesh, ensemble_axis: str, data_axis: str) -> None:
    shape = dict(mesh.shape)
    if ensemble_axis not in shape:
        devices = mesh.devices.size
        raise ValueError(
            f"The mesh has axes {shape} but no {ensemble_axis!r} axis, which an ensemble's "
            f"members are split over. Build the mesh with one, e.g. "
            f"meshkit.make_mesh('{ensemble_axis}=-1') for one member group per device "
            f"(the Flax ensembling HOWTO's layout) or "
            f"meshkit.make_mesh('{ensemble_axis}=2,{data_axis}=-1') to also split each batch; "
            f"the sizes must multiply to the {devices} devices."
        )
    if data_axis == ensemble_axis:
        raise ValueError(
            f"ensemble_axis and data_axis are both {data_axis!r}; members and batch rows "
            "need two different mesh axes."
        )
    others = {name: size for name, size in shape.items() if name not in (ensemble_axis, data_axis)}
    if any(size > 1 for size in others.values()):
        raise ValueError(
            f"The mesh {shape} has axes {others} besides {ensemble_axis!r} and {data_axis!r}; "
            "an ensemble step would replicate all of its work over them. Fold those devices "
            f"into {ensemble_axis!r} or {data_axis!r} (e.g. "
            f"meshkit.make_mesh('{ensemble_axis}={shape[ensemble_axis]},{data_axis}=-1'))."
        )


@dataclasses.dataclass(frozen=True)
class EnsembleLayout:
    """How ``num_members`` members and their batches are laid out on a mesh.

    Every leaf of the ensemble's state carries a leading member axis of size
    ``num_members`` (K), split over the mesh axis ``ensemble_axis`` (E devices), so each
    device holds ``members_per_device = K / E`` members. Batches are split over
    ``data_axis`` (D devices; a mesh without that axis has D = 1). Any K that E divides
    works on any mesh of E × D devices: E = 1 puts every member on every device group,
    D = 1 is the one-member-per-device layout of a ``pmap`` ensemble.

    The constructor checks the mesh and K, and says how to fix them.

    Attributes:
      mesh: the device mesh.
      num_members: K, the ensemble size.
      ensemble_axis: the mesh axis the members are split over.
      data_axis: the mesh axis each batch is split over (optional on the mesh).

    Examples:
        >>> import meshkit
        >>> from meshkit.ensemble import EnsembleLayout
        >>> layout = EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), num_members=2)
        >>> layout.ensemble_size, layout.members_per_device
        (1, 2)
        >>> layout.state_sharding.spec
        P('ensemble',)
        >>> EnsembleLayout(meshkit.make_mesh("data=-1"), num_members=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The mesh has axes {'data': ...} but no 'ensemble' axis, ...
    """

    mesh: Mesh
    num_members: int
    ensemble_axis: str = ENSEMBLE_AXIS
    data_axis: str = DATA_AXIS

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"EnsembleLayout needs a jax.sharding.Mesh, got {type(self.mesh).__name__}; "
                "build one with meshkit.make_mesh('ensemble=-1')."
            )
        num_members = _check_num_members(self.num_members)
        object.__setattr__(self, "num_members", num_members)
        _check_axes(self.mesh, self.ensemble_axis, self.data_axis)
        size = self.ensemble_size
        if num_members % size:
            fits = _divisors(math.gcd(num_members, self.mesh.devices.size))
            raise ValueError(
                f"num_members={num_members} cannot be split evenly over the "
                f"{self.ensemble_axis!r} mesh axis of size {size} (mesh {dict(self.mesh.shape)}): "
                f"every device must hold the same number of members, so K must be a multiple "
                f"of {size}. Use num_members={size * max(1, round(num_members / size))} (or "
                f"another multiple of {size}), or a mesh whose {self.ensemble_axis!r} axis "
                f"divides {num_members}, e.g. one of sizes {fits} with the remaining devices on "
                f"{self.data_axis!r}."
            )

    @property
    def ensemble_size(self) -> int:
        """E: devices along the ensemble axis."""
        return int(self.mesh.shape[self.ensemble_axis])

    @property
    def data_size(self) -> int:
        """D: devices along the data axis (1 when the mesh has none)."""
        return int(self.mesh.shape.get(self.data_axis, 1))

    @property
    def has_data_axis(self) -> bool:
        """Whether the mesh has the data axis (a mesh without it has D = 1)."""
        return self.data_axis in self.mesh.shape

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis batch rows are split over: ``data_axis``, or ``None`` without one."""
        return self.data_axis if self.has_data_axis else None

    @property
    def members_per_device(self) -> int:
        """m = K / E: members each device trains, one after the other."""
        return self.num_members // self.ensemble_size

    @property
    def member_spec(self) -> PartitionSpec:
        """``P(ensemble_axis)``: the member axis of every state leaf split over the ensemble."""
        return PartitionSpec(self.ensemble_axis)

    @property
    def batch_spec(self) -> PartitionSpec:
        """``P(data_axis)`` (rows split over the data axis), or ``P()`` without one."""
        return PartitionSpec(self.data_axis) if self.has_data_axis else PartitionSpec()

    @property
    def state_sharding(self) -> NamedSharding:
        """The sharding of every leaf of an ensemble state (a prefix for the whole state)."""
        return NamedSharding(self.mesh, self.member_spec)

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of a batch: rows over the data axis, replicated over the ensemble."""
        return NamedSharding(self.mesh, self.batch_spec)

    def __repr__(self) -> str:
        return (
            f"EnsembleLayout(num_members={self.num_members}, {self.ensemble_axis}="
            f"{self.ensemble_size}, {self.data_axis}={self.data_size}, "
            f"members_per_device={self.members_per_device})"
        )
