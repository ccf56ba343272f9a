"""Logical axis names: the table that maps them to mesh axes, and where a tree carries them.

A model names the dimensions of its parameters (``("embed", "mlp")``) and of its
activations (``("batch", "length", "embed")``); a table maps each name to mesh axes.
Flax linen carries the names in ``nn.LogicallyPartitioned`` / ``nn.Partitioned``
boxes, NNX in each variable's ``out_sharding`` metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from meshkit._pytree import path_str
from meshkit._specs import entry_axis_names

Names = tuple[str | None, ...]
"""One logical name per dimension of an array; ``None`` for a dimension left unnamed."""

MeshAxes = str | tuple[str, ...] | None
"""What a logical name maps to: a mesh axis, several (sharded over their product), or none."""

LogicalTable = tuple[tuple[str, MeshAxes], ...]
"""``(logical name, mesh axes)`` pairs in priority order; a name may appear more than once."""

LogicalTableLike = Mapping[str, Any] | Sequence[tuple[str, Any]]
"""A table as a dict ``{"embed": "data", "mlp": ("model",)}`` or MaxText-style pairs."""


def _mesh_axes(value: Any, name: str) -> MeshAxes:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(axis, str) for axis in value):
        axes = tuple(value)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    raise TypeError(
        f"Logical axis {name!r} maps to {value!r}; expected a mesh axis name, a list or tuple "
        "of mesh axis names, or None (replicated), e.g. {'embed': 'data', 'mlp': ['model']}."
    )


def logical_table(table: LogicalTableLike) -> LogicalTable:
    """The table as ``(name, mesh axes)`` pairs: lists become tuples, one-axis tuples a name.

    A dict keeps its order. A sequence of pairs may repeat a name: when a leaf's spec
    is built, the first of its entries whose mesh axes that spec does not use yet
    applies (MaxText's rule).

    Examples:
        >>> logical_table({"batch": "data", "mlp": ["model"], "embed": None})
        (('batch', 'data'), ('mlp', 'model'), ('embed', None))
        >>> logical_table([("embed", ["data", "model"]), ("embed", "data")])
        (('embed', ('data', 'model')), ('embed', 'data'))
    """
    items = list(table.items()) if isinstance(table, Mapping) else table
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise TypeError(
            f"A logical table must be a dict or a sequence of (name, mesh axes) pairs, got "
            f"{type(table).__name__}: {table!r}."
        )
    pairs = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"Each logical table entry must be a (name, mesh axes) pair such as "
                f"('embed', 'data'), got {item!r}."
            )
        pairs.append((item[0], _mesh_axes(item[1], item[0])))
    return tuple(pairs)


def table_axis_names(table: LogicalTable) -> tuple[str, ...]:
    """Every mesh axis the table refers to, each once, in order."""
    return tuple(dict.fromkeys(axis for _, axes in table for axis in entry_axis_names(axes)))


def assign(
    names: Names, table: LogicalTable, *, leaf: str
) -> tuple[list[MeshAxes], tuple[str, ...]]:
    """The mesh axes of each dimension named ``names``, and what could not be assigned.

    Entries apply in table order (flax's ``logical_to_mesh_axes``): an entry assigns
    its mesh axes to the dimension with its name unless that dimension already has
    an assignment or the spec already uses one of those axes. A dimension whose every
    entry was refused stays unsharded, and a message says why.

    Raises:
      ValueError: a name is not in the table, or appears twice in ``names``.
    """
    known = {name for name, _ in table}
    for name in names:
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"{leaf}: logical axis names must be strings or None, got {name!r} in {names}."
            )
        if name is not None and name not in known:
            raise ValueError(
                f"{leaf}: logical axis {name!r} (from its names {names}) is not in the logical "
                f"table, which has {sorted(known)}. Add it to the table, e.g. "
                f"{{{name!r}: 'model'}}, or map it to None to keep that dimension replicated."
            )
    repeated = sorted({name for name in names if name is not None and names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{leaf}: logical axis {repeated[0]!r} names more than one dimension in {names}; "
            "give each dimension its own name (or None)."
        )
    unset = object()
    result: list[Any] = [unset if name is not None else None for name in names]
    refused: dict[int, list[str]] = {}
    for name, axes in table:
        if name not in names or result[names.index(name)] is not unset:
            continue
        dim = names.index(name)
        wanted = set(entry_axis_names(axes))
        users = [
            (other, names[other])
            for other, entry in enumerate(result)
            if entry is not unset and wanted & set(entry_axis_names(entry))
        ]
        if users:
            other, other_name = users[0]
            refused.setdefault(dim, []).append(
                f"{axes!r}, which dimension {other} ({other_name!r}) already uses"
            )
            continue
        result[dim] = axes
    messages = []
    for dim, entry in enumerate(result):
        if entry is unset:
            result[dim] = None
            messages.append(
                f"{leaf}: logical axis {names[dim]!r} (dimension {dim}) maps to "
                f"{' or '.join(refused.get(dim, ['nothing']))}; left unsharded along it"
            )
    return result, tuple(messages)


def _flax_module(name: str) -> Any:
    """The flax module ``name``, if imported: if not, no tree can hold its types."""
    return sys.modules.get(name)


def _is_linen_box(x: Any) -> bool:
    meta = _flax_module("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def _is_nnx_variable(x: Any) -> bool:
    nnx = _flax_module("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _box_names(x: Any, where: str) -> Names | None:
    if _is_linen_box(x):
        names = getattr(x, "names", None)
    elif _is_nnx_variable(x):
        names = x.get_metadata().get("out_sharding")
    else:
        return None
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(
            f"{where}: meshkit reads logical axis names as a tuple of strings or None, one per "
            f"dimension, e.g. ('embed', 'mlp'); this leaf carries {names!r}."
        )
    return tuple(names)


def unbox(tree: Any) -> Any:
    """``tree`` with every flax linen box (``nn.Partitioned`` and the like) replaced by its value.

    NNX variables stay: they are the structure an NNX model's state is split into.
    """
    return jax.tree.map(lambda x: x.value if _is_linen_box(x) else x, tree, is_leaf=_is_linen_box)


def leaf_names(tree: Any, names: Any | None = None) -> tuple[Any, list[Names | None]]:
    """``tree`` unboxed, and the logical names of each of its leaves (``None``: none).

    Names come from ``names`` when given (a tree of the unboxed structure, as
    ``logical_axes`` returns), else from the tree's boxes and NNX variables.
    """
    plain = unbox(tree)
    structure = jax.tree.structure(plain)
    if names is not None:
        try:
            return plain, list(structure.flatten_up_to(names))
        except (ValueError, TypeError) as error:
            raise ValueError(
                "The names tree does not match the tree's structure: pass one name tuple "
                "(or None) per leaf, in a tree built like meshkit.logical_axes(tree). "
                f"({error})"
            ) from None
    found: list[Names | None] = []
    is_box = lambda x: _is_linen_box(x) or _is_nnx_variable(x)  # noqa: E731
    for path, item in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        box_names = _box_names(item, path_str(path) or "<root>")
        found.extend([box_names] * len(jax.tree.leaves(unbox(item))))
    return plain, found


def split_axes_collections(variables: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Names]]:
    """``variables`` without the ``<collection>_axes`` collections of flax's older
    ``param_with_axes`` style, and the names those give parameters, by path.

    ``flax.linen.partitioning.param_with_axes(name, init, shape, axes=("embed", "mlp"))``
    keeps a parameter's names in a separate ``params_axes`` collection, as
    ``{"Dense_0": {"kernel_axes": AxisMetadata(names=("embed", "mlp"))}}``; they are
    metadata, not state.
    """
    partitioning = _flax_module("flax.linen.partitioning")
    if partitioning is None:
        return dict(variables), {}
    metadata = partitioning.AxisMetadata
    is_metadata = lambda x: isinstance(x, metadata)  # noqa: E731
    rest: dict[str, Any] = {}
    names: dict[str, Names] = {}
    for collection, value in variables.items():
        leaves = jax.tree_util.tree_leaves_with_path(value, is_leaf=is_metadata)
        if not (collection.endswith("_axes") and leaves and all(is_metadata(x) for _, x in leaves)):
            rest[collection] = value
            continue
        if collection == "params_axes":
            for path, axes in leaves:
                names[path_str(path).removesuffix("_axes")] = tuple(axes.names)
    return rest, names


def logical_axes(tree: Any) -> Any:
    """The logical axis names of every leaf of ``tree``: a tuple of names, or ``None``.

    Reads flax linen boxes (``nn.with_logical_partitioning`` and ``nn.with_partitioning``
    put them on parameters; ``jax.eval_shape(module.init, ...)`` keeps them) and NNX
    variables' ``out_sharding`` metadata (``nnx.with_partitioning``). The result has
    the structure of the unboxed tree, so it can be passed as ``names=`` beside the
    plain parameters.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, meshkit
        >>> init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
        >>> layer = nn.Dense(8, kernel_init=init)
        >>> boxed = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((1, 4)))
        >>> meshkit.logical_axes(boxed)
        {'params': {'bias': None, 'kernel': ('embed', 'mlp')}}
    """
    plain, names = leaf_names(tree)
    return jax.tree.unflatten(jax.tree.structure(plain), names)


@dataclasses.dataclass(frozen=True)
class ActivationRules:
    """The logical table and mesh that activation constraints resolve against in a step.

    ``scope()`` enters flax's ``logical_axis_rules`` and the mesh as the abstract mesh
    context, so ``nn.with_logical_constraint(x, ("batch", "embed"))`` inside a model
    becomes a sharding constraint on this mesh while the step is traced.

    Attributes:
      table: the logical table, in priority order.
      mesh: the mesh the names resolve to.
    """

    table: LogicalTable
    mesh: Mesh

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Flax's logical axis rules and this mesh, for the code inside the ``with``."""
        from flax.core.spmd import logical_axis_rules

        with (
            logical_axis_rules(self.table),
            jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh),
        ):
            yield
