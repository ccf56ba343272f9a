"""Partition rules: ordered (regex -> PartitionSpec) lists that shard a parameter tree."""

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

from meshkit._mesh import DATA_AXIS, check_axis_names
from meshkit._pytree import path_str
from meshkit._specs import entry_axis_names, spec_axis_names

logger = logging.getLogger("meshkit")


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallelism for one leaf: shard its largest divisible dimension.

    The dimension chosen is the largest one divisible by the size of ``axis``; leaves
    with fewer than ``min_size`` elements stay replicated (sharding them saves little
    memory and costs a collective each).

    Attributes:
      axis: the mesh axis (or axes) to shard over, usually the data axis.
      min_size: leaves with fewer elements than this are replicated.
    """

    axis: str | tuple[str, ...] = DATA_AXIS
    min_size: int = 2**14

    def __post_init__(self) -> None:
        if not entry_axis_names(self.axis):
            raise ValueError("FSDP needs a mesh axis name, e.g. FSDP('data').")
        if self.min_size < 0:
            raise ValueError(f"FSDP min_size must be >= 0, got {self.min_size}.")


REPLICATED = PartitionSpec()

Rule = PartitionSpec | FSDP
"""What a rule maps a parameter to: a ``PartitionSpec`` or an ``FSDP`` rule."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """The outcome of the rules for one leaf.

    Attributes:
      path: the leaf's path, keys joined by ``/`` (``params/Dense_0/kernel``).
      shape: the leaf's shape.
      pattern: the regex that matched, or ``None`` when the default applied.
      spec: the ``PartitionSpec`` the leaf gets.
      dropped: one message per mesh axis the rule asked for but that could not apply.
    """

    path: str
    shape: tuple[int, ...]
    pattern: str | None
    spec: PartitionSpec
    dropped: tuple[str, ...] = ()


class PartitionRules:
    """An ordered list of ``(regex, rule)`` pairs; for each leaf the first match wins.

    A regex is searched (``re.search``) in the leaf's path, whose keys are joined by
    ``/``, e.g. ``params/Dense_0/kernel``. A rule is a ``PartitionSpec`` (shorter
    specs are padded with ``None``; trailing ``None``s are dropped from the result)
    or an ``FSDP`` rule. Leaves that no rule matches get ``default`` (replicated
    unless you say otherwise). Mesh axes that do not
    divide a dimension are dropped for that leaf and reported.

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
    """

    def __init__(self, rules: Sequence[tuple[str, Rule]] = (), *, default: Rule = REPLICATED):
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
        self.default = default

    @classmethod
    def fsdp(
        cls, axis: str | tuple[str, ...] = DATA_AXIS, *, min_size: int = 2**14
    ) -> PartitionRules:
        """Rules that FSDP-shard every leaf with at least ``min_size`` elements over ``axis``."""
        return cls([(".*", FSDP(axis, min_size))])

    @property
    def rules(self) -> tuple[tuple[str, Rule], ...]:
        """The ``(pattern, rule)`` pairs, in order."""
        return tuple((regex.pattern, rule) for regex, rule in self._rules)

    def __repr__(self) -> str:
        lines = [f"  {pattern!r} -> {rule!r}" for pattern, rule in self.rules]
        lines.append(f"  default -> {self.default!r}")
        return "PartitionRules(\n" + "\n".join(lines) + "\n)"

    def resolve(self, tree: Any, mesh: Mesh) -> list[Placement]:
        """The placement of every leaf of ``tree`` on ``mesh``, in leaf order."""
        for pattern, rule in [*self.rules, ("default", self.default)]:
            names = rule_axis_names(rule)
            check_axis_names(mesh, names, what=f"partition rule {pattern!r} -> {rule!r}")
        placements = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = path_str(path)
            shape = tuple(int(d) for d in getattr(leaf, "shape", np.shape(leaf)))
            pattern, rule = next(
                ((regex.pattern, rule) for regex, rule in self._rules if regex.search(name)),
                (None, self.default),
            )
            spec, dropped = _apply(rule, name, shape, mesh, pattern)
            placements.append(Placement(name, shape, pattern, spec, dropped))
        return placements


def rule_axis_names(rule: Rule) -> tuple[str, ...]:
    """The mesh axes a rule refers to."""
    return entry_axis_names(rule.axis) if isinstance(rule, FSDP) else spec_axis_names(rule)


def _check_rule(rule: Any, *, where: str) -> None:
    if not isinstance(rule, PartitionSpec | FSDP):
        raise TypeError(
            f"{where}: expected a jax.sharding.PartitionSpec or meshkit.FSDP, got "
            f"{type(rule).__name__}: {rule!r}."
        )


def _apply(
    rule: Rule, name: str, shape: tuple[int, ...], mesh: Mesh, pattern: str | None
) -> tuple[PartitionSpec, tuple[str, ...]]:
    if isinstance(rule, FSDP):
        return _apply_fsdp(rule, name, shape, mesh)
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


def _apply_fsdp(
    rule: FSDP, name: str, shape: tuple[int, ...], mesh: Mesh
) -> tuple[PartitionSpec, tuple[str, ...]]:
    axes = entry_axis_names(rule.axis)
    size = math.prod(mesh.shape[axis] for axis in axes)
    if math.prod(shape) < rule.min_size or size == 1:
        return PartitionSpec(), ()
    by_size = sorted(range(len(shape)), key=lambda i: (-shape[i], -i))
    dim = next((i for i in by_size if shape[i] % size == 0), None)
    if dim is None:
        return PartitionSpec(), (
            f"{name}: no dimension of shape {shape} is divisible by mesh axes {axes} "
            f"(size {size}); left replicated",
        )
    entry = axes[0] if len(axes) == 1 else axes
    return canonical_spec([entry if i == dim else None for i in range(len(shape))]), ()


def canonical_spec(entries: Sequence[Any]) -> PartitionSpec:
    """A ``PartitionSpec`` without trailing ``None``s: ``P('data')``, not ``P('data', None)``."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def infer_shardings(tree: Any, mesh: Mesh, rules: PartitionRules | None = None) -> Any:
    """A pytree of ``NamedSharding``s for ``tree``, from ``rules`` (replicated if ``None``).

    ``tree`` may hold arrays or ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``),
    so shardings can be chosen before anything is materialised. Mesh axes dropped
    because they do not divide a dimension are logged once, as a warning on the
    ``meshkit`` logger.

    Examples:
        >>> import jax, jax.numpy as jnp, meshkit
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
        >>> rules = meshkit.PartitionRules([("w", jax.P("data"))])
        >>> shardings = meshkit.infer_shardings(params, mesh, rules)
        >>> shardings["w"].spec
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
    placements = rules.resolve(tree, mesh)
    dropped = [message for placement in placements for message in placement.dropped]
    if dropped:
        logger.warning("Partition rules could not apply in full:\n  %s", "\n  ".join(dropped))
    specs = iter(placement.spec for placement in placements)
    return jax.tree.map(lambda _: NamedSharding(mesh, next(specs)), tree)
