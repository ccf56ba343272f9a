"""How a device runs its members: batched with ``vmap``, or one after the other.

Both give the same members (to float rounding); which is faster depends on the backend.
cuDNN runs the grouped convolutions that ``vmap`` makes of a member's convolutions
well, so on a GPU one batched program beats a chain of small ones (2.1× for the MNIST
CNN at K = 8, batch 32, on an H100). XLA:CPU runs grouped convolutions far slower than
plain ones (36×), so on a CPU the members run one after the other as plain networks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from meshkit.ensemble._layout import EnsembleLayout

MemberStrategy = Literal["auto", "vmap", "loop"]
"""``"vmap"``: a device's members batched in one program; ``"loop"``: one after the
other, unrolled, each an ordinary network; ``"auto"``: ``vmap`` on GPUs and TPUs,
``loop`` on CPUs."""

STRATEGIES = ("auto", "vmap", "loop")


def resolve_strategy(strategy: object, layout: EnsembleLayout) -> Literal["vmap", "loop"]:
    """The strategy to use on ``layout``'s devices (``"auto"`` chosen by their platform).

    Examples:
        >>> import meshkit
        >>> from meshkit.ensemble import EnsembleLayout
        >>> layout = EnsembleLayout(meshkit.make_mesh("ensemble=-1"), 8)
        >>> resolve_strategy("auto", layout), resolve_strategy("vmap", layout)
        ('loop', 'vmap')
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}: 'vmap' batches "
            "a device's members in one program (fast on GPUs and TPUs), 'loop' runs them "
            "one after the other (fast on CPUs), 'auto' picks by the devices' platform."
        )
    if strategy == "auto":
        return "loop" if layout.mesh.devices.flat[0].platform == "cpu" else "vmap"
    return strategy  # pyright: ignore[reportReturnType]


def map_members(
    fn: Callable[..., Any],
    strategy: Literal["vmap", "loop"],
    num_members: int,
    *args: Any,
    in_axes: tuple[int | None, ...],
) -> Any:
    """``fn`` on each member's slice of ``args`` (sliced on ``in_axes``), outputs stacked.

    Like ``jax.vmap(fn, in_axes)(*args)`` in both strategies; ``"loop"`` calls ``fn``
    once per member on plain slices and stacks the outputs on a new leading axis.
    """
    if strategy == "vmap":
        return jax.vmap(fn, in_axes=in_axes)(*args)
    outputs = []
    for index in range(num_members):  # unrolled at trace time: plain networks
        member_args = [
            arg
            if axis is None
            else jax.tree.map(lambda leaf, i=index, a=axis: _take(leaf, i, a), arg)
            for arg, axis in zip(args, in_axes, strict=True)
        ]
        outputs.append(fn(*member_args))
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outputs)


def _take(leaf: jax.Array, index: int, axis: int) -> jax.Array:
    return jax.lax.index_in_dim(leaf, index, axis, keepdims=False)
