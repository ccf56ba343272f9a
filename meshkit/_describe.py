"""Readable reports of meshes and of the shardings of whole pytrees."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

from meshkit._logical import Names, leaf_names
from meshkit._pytree import path_str


def format_bytes(num_bytes: float) -> str:
    """Bytes as ``describe`` prints them: whole bytes below 1 KiB, one decimal above.

    Examples:
        >>> format_bytes(4), format_bytes(1536), format_bytes(3 * 2**30)
        ('4 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _plural(count: int, noun: str) -> str:
    suffix = "" if count == 1 else "es" if noun.endswith("s") else "s"
    return f"{count} {noun}{suffix}"


def _axis_type_name(axis_type: Any) -> str:
    return getattr(axis_type, "name", str(axis_type))


def _describe_mesh(mesh: Mesh) -> str:
    axes = " × ".join(f"{name}={size}" for name, size in mesh.shape.items())
    types = ", ".join(_axis_type_name(t) for t in mesh.axis_types)
    processes = len({d.process_index for d in mesh.devices.flat})
    platform = mesh.devices.flat[0].platform
    lines = [
        f"Mesh {axes}  axis types ({types})  {_plural(mesh.devices.size, platform + ' device')} "
        f"in {_plural(processes, 'process')}",
    ]
    grid = np.vectorize(lambda d: f"{d.id}@p{d.process_index}", otypes=[object])(mesh.devices)
    if grid.ndim == 1:
        grid = grid[None, :]
        row_labels = [""]
        col_name = mesh.axis_names[0]
    else:
        row_names = mesh.axis_names[:-1]
        row_labels = [
            ",".join(f"{n}={i}" for n, i in zip(row_names, index, strict=True))
            for index in np.ndindex(*grid.shape[:-1])
        ]
        grid = grid.reshape(-1, grid.shape[-1])
        col_name = mesh.axis_names[-1]
    width = max(*(len(cell) for cell in grid.flat), len(f"{col_name}={grid.shape[1] - 1}"))
    label_width = max(len(label) for label in row_labels)
    header = (
        " " * label_width
        + "  "
        + "  ".join(f"{col_name}={j}".ljust(width) for j in range(grid.shape[1]))
    )
    lines.append("device@process:")
    lines.append(header.rstrip())
    for label, row in zip(row_labels, grid, strict=True):
        lines.append(
            (label.ljust(label_width) + "  " + "  ".join(c.ljust(width) for c in row)).rstrip()
        )
    return "\n".join(lines)


def _leaf_sharding(leaf: Any) -> Sharding | None:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, Sharding) else None


def _spec_str(sharding: Sharding | None) -> str:
    if sharding is None:
        return "host (not on devices)"
    if isinstance(sharding, NamedSharding):
        return "P(" + ", ".join(map(repr, sharding.spec)) + ")"
    if sharding.is_fully_replicated:
        return "replicated"
    return type(sharding).__name__


def _names_str(names: Names | None) -> str:
    return "-" if names is None else repr(tuple(names))


def _describe_tree(tree: Any, shardings: Any | None, names: Any | None, show_mesh: bool) -> str:
    tree, leaf_logical = leaf_names(tree, names)
    show_logical = any(n is not None for n in leaf_logical)
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if shardings is None:
        leaf_shardings = [_leaf_sharding(leaf) for _, leaf in leaves]
    else:
        leaf_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
        if len(leaf_shardings) != len(leaves):
            raise ValueError(
                f"shardings has {len(leaf_shardings)} leaves but the tree has {len(leaves)}; "
                "pass a pytree of shardings with the same structure (e.g. from infer_shardings)."
            )
    rows = []
    total = per_device = 0
    meshes = []
    for (path, leaf), sharding, logical in zip(leaves, leaf_shardings, leaf_logical, strict=True):
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf))
        nbytes = math.prod(shape) * dtype.itemsize
        shard_bytes = None
        if sharding is not None:
            shard_bytes = math.prod(sharding.shard_shape(shape)) * dtype.itemsize
            per_device += shard_bytes
            mesh = getattr(sharding, "mesh", None)
            if isinstance(mesh, Mesh) and mesh not in meshes:
                meshes.append(mesh)
        total += nbytes
        rows.append(
            (
                path_str(path) or "<root>",
                str(shape),
                dtype.name,
                *((_names_str(logical),) if show_logical else ()),
                _spec_str(sharding),
                "-" if shard_bytes is None else format_bytes(shard_bytes),
                format_bytes(nbytes),
            )
        )
    header = ("path", "shape", "dtype", *(("logical",) if show_logical else ()), "spec")
    header += ("per device", "global")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

    lines = [_describe_mesh(mesh) for mesh in meshes] if show_mesh else []
    lines += [fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)]
    lines.append(
        f"{len(rows)} leaves: {format_bytes(total)} in all, {format_bytes(per_device)} per device"
    )
    return "\n".join(lines)


def describe(
    tree: Any, shardings: Any | None = None, *, names: Any | None = None, show_mesh: bool = True
) -> str:
    """A readable report of a mesh, or of the shardings of every leaf of a pytree.

    For a pytree, each leaf gets its path, shape, dtype, ``PartitionSpec``, bytes per
    device and global bytes, followed by the total per device; the mesh(es) the leaves
    live on are printed first. Leaves may be ``jax.Array``s, or abstract
    ``jax.ShapeDtypeStruct``s with a ``shardings`` tree beside them (e.g. from
    ``jax.eval_shape`` and ``infer_shardings``), so a layout can be checked before
    anything is allocated.

    Leaves with logical axis names get them in a ``logical`` column beside their
    spec: names read from flax linen boxes or NNX variables in ``tree``, or given as
    ``names`` (``meshkit.logical_axes``; for a train state, ``state.logical_axes()``).

    Args:
      tree: a ``jax.sharding.Mesh`` or a pytree.
      shardings: optional pytree of shardings matching ``tree``; by default each
        leaf's own ``.sharding`` is used.
      names: optional pytree of logical names (a tuple or ``None`` per leaf).
      show_mesh: whether a pytree's report starts with its mesh(es).

    Returns:
      The report, as a string.

    Examples:
        >>> import numpy as np, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> tree = meshkit.replicate({"w": np.zeros((4, 4), np.float32)}, mesh)
        >>> print(describe(tree).splitlines()[-1])
        1 leaves: 64 B in all, 64 B per device
        >>> report = describe(tree, names={"w": ("embed", "mlp")}, show_mesh=False)
        >>> print(report.splitlines()[2])
        w     (4, 4)  float32  ('embed', 'mlp')  P()   64 B        64 B
    """
    if isinstance(tree, Mesh):
        if shardings is not None or names is not None:
            raise ValueError(
                "describe(mesh) takes no shardings or names; pass a pytree to see shardings."
            )
        return _describe_mesh(tree)
    return _describe_tree(tree, shardings, names, show_mesh)
