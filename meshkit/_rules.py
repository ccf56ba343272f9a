"""Partition rules: ordered (regex -> rule) lists, and logical axis tables, that shard a tree."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._logical import (
    LogicalTable,
    LogicalTableLike,
    Names,
    assign,
    leaf_names,
    logical_table,
    table_axis_names,
    unbox,
)
from meshkit._mesh import DATA_AXIS, check_axis_names
from meshkit._pytree import path_str
from meshkit._specs import entry_axis_names, spec_axis_names

logger = logging.getLogger("meshkit")


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallelism for one leaf: shard its largest divisible dimension.

    The dimension chosen is the largest one divisible by the size of ``axis``; leaves
    smaller than the threshold stay replicated (sharding them saves little memory and
    costs a collective each).

    Attributes:
      axis: the mesh axis (or axes) to shard over, usually the data axis.
      min_size: leaves with fewer elements than this are replicated.
      min_bytes: when given, replaces ``min_size``: leaves of fewer bytes than this are
        replicated, whatever their dtype (big_vision's ``min_size_to_shard_mb`` counts
        bytes; a bfloat16 leaf then needs twice the elements of a float32 one).
      base: a spec applied first, as a ``PartitionSpec`` rule would apply it (e.g.
        ``P(None, "model")`` for tensor parallelism); FSDP then shards the largest
        dimension the base leaves unsharded. One leaf, two rules chained, as
        big_vision's ``("dim", ...)`` followed by ``("fsdp", ...)``.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> FSDP("data", min_bytes=2**20, base=P(None, "model"))
        FSDP(axis='data', min_bytes=1048576, base=P(None, 'model'))
    """

    axis: str | tuple[str, ...] = DATA_AXIS
    min_size: int = 2**14
    min_bytes: int | None = None
    base: PartitionSpec | None = None

    def __post_init__(self) -> None:
        if not entry_axis_names(self.axis):
            raise ValueError("FSDP needs a mesh axis name, e.g. FSDP('data').")
        if self.min_size < 0:
            raise ValueError(f"FSDP min_size must be >= 0, got {self.min_size}.")
        if self.min_bytes is not None and self.min_bytes < 0:
            raise ValueError(f"FSDP min_bytes must be >= 0 (or None), got {self.min_bytes}.")
        if self.base is not None and not isinstance(self.base, PartitionSpec):
            raise TypeError(
                f"FSDP base must be a PartitionSpec such as P(None, 'model'), got {self.base!r}."
            )
        shared = set(spec_axis_names(self.base or PartitionSpec())) & set(
            entry_axis_names(self.axis)
        )
        if shared:
            raise ValueError(
                f"FSDP over {self.axis!r} with base {self.base}: the base already uses "
                f"{sorted(shared)}; FSDP shards over another axis than the base's."
            )

    def __repr__(self) -> str:
        threshold = (
            f"min_size={self.min_size}" if self.min_bytes is None else f"min_bytes={self.min_bytes}"
        )
        base = "" if self.base is None else f", base={self.base!r}"
        return f"FSDP(axis={self.axis!r}, {threshold}{base})"

    def too_small(self, shape: tuple[int, ...], itemsize: int) -> bool:
        """Whether a leaf of ``shape`` and ``itemsize`` bytes per element stays replicated."""
        elements = math.prod(shape)
        if self.min_bytes is not None:
            return elements * itemsize < self.min_bytes
        return elements < self.min_size


REPLICATED = PartitionSpec()

Rule = PartitionSpec | FSDP
"""What a rule maps a parameter to: a ``PartitionSpec`` or an ``FSDP`` rule."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """The outcome of the rules for one leaf.

    Attributes:
      path: the leaf's path, keys joined by ``/`` (``params/Dense_0/kernel``).
      shape: the leaf's shape.
      pattern: the regex that matched, or ``None`` when no regex did.
      spec: the ``PartitionSpec`` the leaf gets.
      dropped: one message per mesh axis the rule asked for but that could not apply.
      logical: the leaf's logical axis names when the logical table placed it, else
        ``None`` (``pattern`` and ``logical`` both ``None``: the default placed it).
    """

    path: str
    shape: tuple[int, ...]
    pattern: str | None
    spec: PartitionSpec
    dropped: tuple[str, ...] = ()
    logical: Names | None = None


class PartitionRules:
    """How a tree is sharded: ordered regex rules, a logical axis table, and a default.

    For each leaf, in this order of precedence:

    1. **Regex rules**, ``(regex, rule)`` pairs where the first match wins. A regex is
       searched (``re.search``) in the leaf's path, whose keys are joined by ``/``,
       e.g. ``params/Dense_0/kernel``. A rule is a ``PartitionSpec`` (shorter specs are
       padded with ``None``; trailing ``None``s are dropped from the result) or an
       ``FSDP`` rule.
    2. **The logical table** (``logical``), for a leaf that carries logical axis names
       (flax's ``nn.with_logical_partitioning``, ``nn.with_partitioning`` or NNX's
       ``nnx.with_partitioning``): each name maps to a mesh axis, a tuple of mesh axes,
       or ``None`` (replicated). Every name a leaf carries must be in the table. Two
       names asking for the same mesh axis: the table's earlier entry gets it and the
       other dimension stays unsharded (reported). A name that is not in the table
       but is an axis of the mesh means that axis, as flax's ``nn.with_partitioning``
       and ``nnx.with_partitioning`` mean it; without a table, that holds for every
       name. Names that are neither leave the leaf to the default, and a warning names
       each such leaf the default leaves replicated.
    3. **The default** (replicated unless you say otherwise; ``FSDP()`` for FSDP).

    Mesh axes that do not divide a dimension are dropped for that leaf and reported,
    whichever of the three placed it.

    The table is a dict ``{"embed": "data", "mlp": ("model",)}`` or MaxText-style
    ``(name, axes)`` pairs, where a name may appear more than once: the first of its
    entries whose mesh axes the leaf's spec does not use yet applies. The same table
    resolves ``nn.with_logical_constraint`` on activations inside train and eval steps
    (see ``meshkit.train.create_train_state``).

    Args:
      rules: ``(regex, rule)`` pairs, first match wins.
      logical: the logical table, or ``None`` to ignore logical names.
      default: the rule for leaves nothing else placed.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> rules = PartitionRules([
        ...     (r"embedding", P("model", None)),
        ...     (r"kernel", FSDP("data", min_size=1024)),
        ... ])
        >>> print(rules)
        PartitionRules(
          'embedding' -> P('model', None)
          'kernel' -> FSDP(axis='data', min_size=1024)
          default -> P()
        )
        >>> print(PartitionRules(logical=[("embed", "data"), ("mlp", ["model"])]))
        PartitionRules(
          logical 'embed' -> 'data'
          logical 'mlp' -> 'model'
          default -> P()
        )
    """

    def __init__(
        self,
        rules: Sequence[tuple[str, Rule]] = (),
        *,
        logical: LogicalTableLike | None = None,
        default: Rule = REPLICATED,
    ):
        compiled = []
        for item in rules:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"Each rule must be a (regex, rule) pair, got {item!r}.")
            pattern, rule = item
            _check_rule(rule, where=f"rule {pattern!r}")
            try:
                compiled.append((re.compile(pattern), rule))
            except re.error as error:
                raise ValueError(
                    f"Rule pattern {pattern!r} is not a valid regex: {error}."
                ) from None
        _check_rule(default, where="default")
        self._rules = tuple(compiled)
        self._logical = None if logical is None else logical_table(logical)
        self.default = default

    @classmethod
    def fsdp(
        cls, axis: str | tuple[str, ...] = DATA_AXIS, *, min_size: int = 2**14
    ) -> PartitionRules:
        """Rules that FSDP-shard every leaf with at least ``min_size`` elements over ``axis``."""
        return cls([(".*", FSDP(axis, min_size))])

    @classmethod
    def from_logical(
        cls,
        table: LogicalTableLike,
        *,
        rules: Sequence[tuple[str, Rule]] = (),
        default: Rule = REPLICATED,
    ) -> PartitionRules:
        """Rules from a logical table (a dict, or MaxText's ``logical_axis_rules`` pairs).

        Examples:
            >>> rules = PartitionRules.from_logical(
            ...     [("batch", "data"), ("embed", "data"), ("embed", None), ("mlp", "model")],
            ...     default=FSDP(),
            ... )
            >>> rules.logical
            (('batch', 'data'), ('embed', 'data'), ('embed', None), ('mlp', 'model'))
        """
        return cls(rules, logical=table, default=default)

    @property
    def rules(self) -> tuple[tuple[str, Rule], ...]:
        """The ``(pattern, rule)`` pairs, in order."""
        return tuple((regex.pattern, rule) for regex, rule in self._rules)

    @property
    def logical(self) -> LogicalTable | None:
        """The logical table as ``(name, mesh axes)`` pairs in priority order, or ``None``."""
        return self._logical

    def __repr__(self) -> str:
        lines = [f"  {pattern!r} -> {rule!r}" for pattern, rule in self.rules]
        lines += [f"  logical {name!r} -> {axes!r}" for name, axes in self._logical or ()]
        lines.append(f"  default -> {self.default!r}")
        return "PartitionRules(\n" + "\n".join(lines) + "\n)"

    def _check_axes(self, mesh: Mesh) -> None:
        for pattern, rule in [*self.rules, ("default", self.default)]:
            names = rule_axis_names(rule)
            check_axis_names(mesh, names, what=f"partition rule {pattern!r} -> {rule!r}")
        if self._logical is not None:
            unknown = [a for a in table_axis_names(self._logical) if a not in mesh.axis_names]
            if unknown:
                users = [n for n, axes in self._logical if unknown[0] in entry_axis_names(axes)]
                raise ValueError(
                    f"Unknown mesh axis {unknown[0]!r} in the logical table (for {users}); "
                    f"the mesh has axes {dict(mesh.shape)}. Map those names to one of "
                    f"{list(mesh.axis_names)} or None, or add the axis to the mesh (size 1 "
                    f"keeps one table for several meshes: 'data=-1,{unknown[0]}=1')."
                )

    def resolve(self, tree: Any, mesh: Mesh, *, names: Any | None = None) -> list[Placement]:
        """The placement of every leaf of ``tree`` on ``mesh``, in leaf order.

        ``tree`` may hold flax linen boxes or NNX variables, whose logical names are
        read (``meshkit.logical_axes``); ``names`` gives them explicitly instead, as a
        tree of the unboxed structure with a tuple of names (or ``None``) per leaf.
        """
        self._check_axes(mesh)
        plain, all_names = leaf_names(tree, names)
        placements = []
        leaves = jax.tree_util.tree_leaves_with_path(plain)
        for (path, leaf), leaf_logical in zip(leaves, all_names, strict=True):
            name = path_str(path)
            shape = tuple(int(d) for d in getattr(leaf, "shape", np.shape(leaf)))
            pattern, rule = next(
                ((regex.pattern, rule) for regex, rule in self._rules if regex.search(name)),
                (None, None),
            )
            if rule is None and leaf_logical is not None:
                table = _with_mesh_axes(self._logical or (), leaf_logical, mesh)
                if self._logical is not None or _all_known(leaf_logical, table):
                    placements.append(_apply_logical(leaf_logical, table, name, shape, mesh))
                    continue
            rule = self.default if rule is None else rule
            spec, dropped = _apply(rule, name, shape, mesh, pattern, itemsize=_itemsize(leaf))
            if pattern is None and leaf_logical is not None and not spec_axis_names(spec):
                dropped += (
                    f"{name}: annotated {leaf_logical}, names that are neither mesh axes of "
                    f"the mesh {dict(mesh.shape)} nor in a logical table; left replicated",
                )
            placements.append(Placement(name, shape, pattern, spec, dropped))
        return placements


def _itemsize(leaf: Any) -> int:
    """Bytes per element of a leaf (a PRNG key array counts its key data's bytes)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return np.asarray(leaf).dtype.itemsize
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes such as key<fry>
        return int(getattr(dtype, "itemsize", 4) or 4)


def _with_mesh_axes(table: LogicalTable, names: Names, mesh: Mesh) -> LogicalTable:
    """``table`` and, after it, each of ``names`` that it lacks but is a mesh axis, as itself.

    Flax's ``nn.with_partitioning`` and ``nnx.with_partitioning`` name mesh axes: a
    name the table does not map but the mesh has means that axis.
    """
    known = {name for name, _ in table}
    own = tuple(
        (name, name)
        for name in dict.fromkeys(names)
        if name is not None and name not in known and name in mesh.axis_names
    )
    return table + own


def _all_known(names: Names, table: LogicalTable) -> bool:
    known = {name for name, _ in table}
    return all(name is None or name in known for name in names)


def rule_axis_names(rule: Rule) -> tuple[str, ...]:
    """The mesh axes a rule refers to."""
    if isinstance(rule, FSDP):
        return (*spec_axis_names(rule.base or PartitionSpec()), *entry_axis_names(rule.axis))
    return spec_axis_names(rule)


def _check_rule(rule: Any, *, where: str) -> None:
    if not isinstance(rule, PartitionSpec | FSDP):
        raise TypeError(
            f"{where}: expected a jax.sharding.PartitionSpec or meshkit.FSDP, got "
            f"{type(rule).__name__}: {rule!r}."
        )


def _apply(
    rule: Rule,
    name: str,
    shape: tuple[int, ...],
    mesh: Mesh,
    pattern: str | None,
    *,
    itemsize: int = 4,
) -> tuple[PartitionSpec, tuple[str, ...]]:
    if isinstance(rule, FSDP):
        return _apply_fsdp(rule, name, shape, mesh, pattern, itemsize=itemsize)
    if len(rule) > len(shape):
        raise ValueError(
            f"Rule {pattern or 'default'!r} gives {name!r} the spec {rule} with {len(rule)} "
            f"entries, but the leaf has shape {shape} ({len(shape)} dims). Write a more "
            "specific pattern for this leaf, or a shorter spec."
        )
    entries: list[Any] = []
    dropped: list[str] = []
    for dim, entry in zip(shape, (*rule, *([None] * (len(shape) - len(rule)))), strict=True):
        names = list(entry_axis_names(entry))
        while names and dim % math.prod(mesh.shape[axis] for axis in names):
            axis = names.pop()
            dropped.append(
                f"{name}: dimension of size {dim} is not divisible by mesh axis {axis!r} "
                f"(size {mesh.shape[axis]}); left unsharded along {axis!r}"
            )
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return canonical_spec(entries), tuple(dropped)


def _apply_logical(
    names: Names, table: LogicalTable, name: str, shape: tuple[int, ...], mesh: Mesh
) -> Placement:
    if len(names) != len(shape):
        raise ValueError(
            f"{name} carries the logical axis names {names} ({len(names)} dims) but has "
            f"shape {shape} ({len(shape)} dims). Name every dimension once (None for a "
            "dimension that needs no name)."
        )
    entries, conflicts = assign(names, table, leaf=name)
    spec, dropped = _apply(PartitionSpec(*entries), name, shape, mesh, "logical")
    return Placement(name, shape, None, spec, conflicts + dropped, logical=names)


def _apply_fsdp(
    rule: FSDP,
    name: str,
    shape: tuple[int, ...],
    mesh: Mesh,
    pattern: str | None = None,
    *,
    itemsize: int = 4,
) -> tuple[PartitionSpec, tuple[str, ...]]:
    base, dropped = (
        _apply(rule.base, name, shape, mesh, pattern) if rule.base is not None else (None, ())
    )
    entries: list[Any] = (
        [None] * len(shape) if base is None else [*base, *([None] * (len(shape) - len(base)))]
    )
    axes = entry_axis_names(rule.axis)
    size = math.prod(mesh.shape[axis] for axis in axes)
    if rule.too_small(shape, itemsize) or size == 1:
        return canonical_spec(entries), dropped
    free = [i for i in range(len(shape)) if entries[i] is None]
    by_size = sorted(free, key=lambda i: (-shape[i], -i))
    dim = next((i for i in by_size if shape[i] % size == 0), None)
    if dim is None:
        return canonical_spec(entries), (
            *dropped,
            f"{name}: no {'unsharded ' if base is not None else ''}dimension of shape {shape} "
            f"is divisible by mesh axes {axes} (size {size}); left "
            f"{'as the base places it' if base is not None else 'replicated'}",
        )
    entries[dim] = axes[0] if len(axes) == 1 else axes
    return canonical_spec(entries), dropped


def canonical_spec(entries: Sequence[Any]) -> PartitionSpec:
    """A ``PartitionSpec`` without trailing ``None``s: ``P('data')``, not ``P('data', None)``."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def infer_shardings(
    tree: Any, mesh: Mesh, rules: PartitionRules | None = None, *, names: Any | None = None
) -> Any:
    """A pytree of ``NamedSharding``s for ``tree``, from ``rules`` (replicated if ``None``).

    ``tree`` may hold arrays or ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``),
    so shardings can be chosen before anything is materialised. It may also hold flax
    linen boxes (``jax.eval_shape(module.init, ...)`` of a module with
    ``nn.with_logical_partitioning``) or NNX variables: their logical names go through
    the rules' logical table, and the result has the unboxed structure (one sharding
    where a box was), which ``jax.jit(module.init, out_shardings=...)`` accepts too.
    ``names`` gives the logical names of a plain tree instead (see ``logical_axes``).
    Mesh axes dropped because they do not divide a dimension, or because another
    dimension already uses them, are logged once, as a warning on the ``meshkit`` logger.

    Examples:
        >>> import jax, jax.numpy as jnp, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
        >>> rules = meshkit.PartitionRules([("w", jax.P("data"))])
        >>> shardings = meshkit.infer_shardings(params, mesh, rules)
        >>> shardings["w"].spec
        P('data',)
        >>> rules = meshkit.PartitionRules(logical={"rows": "data", "cols": None})
        >>> names = {"w": ("rows", "cols")}
        >>> meshkit.infer_shardings(params, mesh, rules, names=names)["w"].spec
        P('data',)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"infer_shardings needs a jax.sharding.Mesh, got {type(mesh).__name__}.")
    rules = PartitionRules() if rules is None else rules
    if not isinstance(rules, PartitionRules):
        raise TypeError(
            f"rules must be a meshkit.PartitionRules, got {type(rules).__name__}. "
            "Wrap (regex, PartitionSpec) pairs: PartitionRules([...])."
        )
    placements = rules.resolve(tree, mesh, names=names)
    dropped = [message for placement in placements for message in placement.dropped]
    if dropped:
        shown = dropped[:8] + ([f"... and {len(dropped) - 8} more"] if len(dropped) > 8 else [])
        replicated = any(
            message.endswith("nor in a logical table; left replicated") for message in dropped
        )
        hint = (
            "\nGive the names a logical table to shard those leaves, "
            "PartitionRules(logical={'embed': 'data', ...}), or map them to None to keep "
            "them replicated without this warning."
            if replicated
            else ""
        )
        logger.warning("Partition rules could not apply in full:\n  %s%s", "\n  ".join(shown), hint)
    structure = jax.tree.structure(unbox(tree))
    return jax.tree.unflatten(
        structure, [NamedSharding(mesh, placement.spec) for placement in placements]
    )
