"""Small helpers over ``PartitionSpec`` entries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.sharding import PartitionSpec


def entry_axis_names(entry: Any) -> tuple[str, ...]:
    """The mesh axis names in one ``PartitionSpec`` entry (``None``, a name, or a tuple)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def spec_axis_names(spec: Iterable[Any]) -> tuple[str, ...]:
    """All mesh axis names a ``PartitionSpec`` uses, in order.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> spec_axis_names(P(("data", "model"), None, "ensemble"))
        ('data', 'model', 'ensemble')
    """
    return tuple(name for entry in spec for name in entry_axis_names(entry))
