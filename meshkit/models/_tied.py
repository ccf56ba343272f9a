"""A tied embedding table under FSDP: gathered once a step, its gradient reduced once.

The table serves the token lookup at the bottom of the model and the logits at the top.
Under FSDP its rows are split along the model width (``embed``), and the batch over the
mesh's batch axes. Left to the partitioner, each use reduced its own partial gradient
of the whole table (two reduce-scatters of the table a step, and two all-reduces of a
shard over ``data``). Here each use leaves its partial gradient on its device, the two
are added there, and one reduce-scatter over the FSDP axes and one all-reduce of the
shard over the other batch axes sum them: FSDP's own traffic for one parameter.

Where the names do not resolve to such a layout (no mesh, the vocabulary split over
devices, FSDP axes that do not split the batch), every function here is its plain
counterpart: the partitioner reduces the gradient where it is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def _mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes a logical axis name resolves to under the rules in force."""
    axes = nn.logical_to_mesh_axes((name,))
    entry = axes[0] if axes else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """Where the table's partial gradients live and how they are summed into its shards."""

    mesh: jax.sharding.AbstractMesh
    batch: tuple[str, ...]
    length: tuple[str, ...]
    shards: tuple[str, ...]  # the FSDP axes splitting the table's width

    @property
    def rows(self) -> tuple[str, ...]:
        """The axes splitting the tokens (batch, then length): those the sum runs over."""
        return (*self.batch, *self.length)

    @property
    def others(self) -> tuple[str, ...]:
        """The axes the sum runs over besides the FSDP shards' (``data``)."""
        return tuple(axis for axis in self.rows if axis not in self.shards)

    @property
    def tokens(self) -> PartitionSpec:
        return PartitionSpec(self.batch or None, self.length or None)

    @property
    def per_token(self) -> PartitionSpec:
        return PartitionSpec(self.batch or None, self.length or None, None)


def _reduction() -> _Reduction | None:
    """The layout of the step being traced, where the explicit reduction applies."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    reduction = _Reduction(mesh, _mesh_axes("batch"), _mesh_axes("length"), _mesh_axes("embed"))
    shards = set(reduction.shards)
    if _mesh_axes("vocab") or not shards or not shards <= set(reduction.rows):
        return None
    return reduction


def _per_device(
    reduction: _Reduction,
    function: Callable[..., jax.Array],
    in_specs: PartitionSpec | tuple[PartitionSpec, ...],
    out_specs: PartitionSpec,
) -> Callable[..., jax.Array]:
    """``function`` on each device's blocks; its result taken as it is on each device
    (``check_vma=False``): a partial sum stays on its device until it is reduced."""
    return jax.shard_map(
        function, mesh=reduction.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


@jax.custom_vjp
def whole_width(table_VxD: jax.Array) -> jax.Array:
    """The table gathered along the model width (its FSDP shards); its gradient summed
    into them. The table is pinned to its shards first, so that the gather moves it in
    the dtype it arrives in (the compute dtype): without the pin the partitioner gathers
    the float32 parameter before its cast, twice the bytes."""
    sharded_VxD = nn.with_logical_constraint(table_VxD, ("vocab", "embed"))
    return nn.with_logical_constraint(sharded_VxD, ("vocab", None))


def _whole_width_forward(table_VxD: jax.Array) -> tuple[jax.Array, None]:
    return whole_width(table_VxD), None


def _whole_width_backward(_: None, grad_VxD: jax.Array) -> tuple[jax.Array]:
    reduction = _reduction()
    if reduction is None:
        return (nn.with_logical_constraint(grad_VxD, ("vocab", "embed")),)
    others = reduction.others  # what the shards sum over besides their own axes

    def reduce(partial_VxD: jax.Array) -> jax.Array:
        # This device's partial gradient (lookup's and logits' added, see lookup and
        # logits), summed into its columns over the FSDP axes, then over the others.
        shard = jax.lax.psum_scatter(partial_VxD, reduction.shards, scatter_dimension=1, tiled=True)
        return jax.lax.psum(shard, others) if others else shard

    summed = _per_device(reduction, reduce, PartitionSpec(), PartitionSpec(None, reduction.shards))
    return (summed(grad_VxD),)


whole_width.defvjp(_whole_width_forward, _whole_width_backward)


def lookup(table_VxD: jax.Array, ids_BxL: jax.Array) -> jax.Array:
    """Rows ``ids_BxL`` of the whole-width table. Under FSDP its gradient is this
    device's share of the batch, left on the device for ``whole_width`` to sum."""
    shape, dtype = table_VxD.shape, table_VxD.dtype

    @jax.custom_vjp
    def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.take(table, ids, axis=0)

    def forward(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rows(table, ids), ids

    def backward(ids: jax.Array, grad_BxLxD: jax.Array) -> tuple[jax.Array, None]:
        def scatter(ids: jax.Array, grad: jax.Array) -> jax.Array:
            return jnp.zeros(shape, dtype).at[ids].add(grad.astype(dtype))

        reduction = _reduction()
        if reduction is None:
            return scatter(ids, grad_BxLxD), None
        specs = (reduction.tokens, reduction.per_token)
        return _per_device(reduction, scatter, specs, PartitionSpec())(ids, grad_BxLxD), None

    rows.defvjp(forward, backward)
    return rows(table_VxD, ids_BxL)


@jax.custom_vjp
def logits(x_BxLxD: jax.Array, table_VxD: jax.Array) -> jax.Array:
    """``x @ table.T``. Under FSDP the table's gradient is this device's share of the
    batch, left on the device for ``whole_width`` to sum."""
    return x_BxLxD @ table_VxD.T


def _logits_forward(
    x_BxLxD: jax.Array, table_VxD: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return logits(x_BxLxD, table_VxD), (x_BxLxD, table_VxD)


def _logits_backward(
    residuals: tuple[jax.Array, jax.Array], grad_BxLxV: jax.Array
) -> tuple[jax.Array, jax.Array]:
    x_BxLxD, table_VxD = residuals
    grad_x = (grad_BxLxV @ table_VxD).astype(x_BxLxD.dtype)

    def table_gradient(x: jax.Array, grad: jax.Array) -> jax.Array:
        return jnp.einsum("blv,bld->vd", grad, x).astype(table_VxD.dtype)

    reduction = _reduction()
    if reduction is None:
        return grad_x, table_gradient(x_BxLxD, grad_BxLxV)
    specs = (reduction.per_token, reduction.per_token)
    partial = _per_device(reduction, table_gradient, specs, PartitionSpec())
    return grad_x, partial(x_BxLxD, grad_BxLxV)


logits.defvjp(_logits_forward, _logits_backward)
