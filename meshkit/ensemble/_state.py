"""The ensemble's state: K train states stacked on a leading member axis, built in place."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from meshkit._checks import check_int
from meshkit._host import replicated_sharding
from meshkit.ensemble._layout import EnsembleLayout
from meshkit.train import Model, Precision, TrainState
from meshkit.train._state import init_state_from_key


def member_keys(seed: int, num_members: int) -> jax.Array:
    """The K member keys: member ``i`` gets ``fold_in(key(seed), i)``.

    A member's key depends only on ``seed`` and its index, so member ``i`` starts from
    the same values whatever the ensemble size or the mesh.

    Examples:
        >>> import jax
        >>> keys = member_keys(0, 3)
        >>> keys.shape
        (3,)
        >>> bool((jax.random.key_data(keys[1])
        ...       == jax.random.key_data(jax.random.fold_in(jax.random.key(0), 1))).all())
        True
    """
    base = jax.random.key(seed)
    return jax.vmap(lambda index: jax.random.fold_in(base, index))(jnp.arange(num_members))


def _init_ensemble(
    model: Model,
    tx: optax.GradientTransformation,
    num_members: int,
    seed: int,
    precision: Precision,
) -> TrainState:
    if model.devices:
        raise ValueError(
            "meshkit.ensemble got a model wrapped by meshkit.train.per_device. Ensemble "
            "members already run per device (batch statistics over each device's rows, as "
            "pmap without axis_name): pass the model without per_device, and drop "
            "axis_name from its BatchNorm layers."
        )
    # A loop over the members (lax.map), not vmap: it runs once, and with several members
    # per device it compiles about twice as fast as the vmapped init (measured in the
    # ensembles guide). The partitioned loop still allocates only each device's members.
    return jax.lax.map(
        functools.partial(init_state_from_key, model, tx, precision=precision),
        member_keys(seed, num_members),
    )


def abstract_ensemble_state(
    model: Model,
    tx: optax.GradientTransformation,
    layout: EnsembleLayout,
    *,
    seed: int = 0,
    precision: Precision | str | None = None,
) -> TrainState:
    """The ensemble state's shapes, dtypes and shardings, without any FLOPs.

    Every leaf is a ``jax.ShapeDtypeStruct`` with a leading member axis and the
    layout's ``state_sharding``: a restore target for ``meshkit.checkpoint.Checkpointer``
    that needs no state in memory.

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 4)
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> abstract = ensemble.abstract_ensemble_state(model, optax.sgd(0.1), layout)
        >>> abstract.params["kernel"].shape, abstract.step.shape
        ((4, 5, 3), (4,))
    """
    policy = Precision.of(precision)
    shapes = jax.eval_shape(lambda: _init_ensemble(model, tx, layout.num_members, seed, policy))
    sharding = layout.state_sharding
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), shapes
    )


def create_ensemble_state(
    model: Model,
    tx: optax.GradientTransformation,
    layout: EnsembleLayout,
    *,
    seed: int = 0,
    precision: Precision | str | None = None,
) -> TrainState:
    """Builds K independently initialised members, stacked and split over the ensemble axis.

    The result is a ``meshkit.train.TrainState`` whose every leaf (``step``, ``params``,
    ``opt_state``, ``collections``, ``rng``) has a leading axis of size K, sharded
    ``P('ensemble')``. Member ``i`` is initialised from ``fold_in(key(seed), i)``
    (``member_keys``), split into its init key and its dropout key as
    ``create_train_state`` does. The state is created by a jit with those
    ``out_shardings``: each device only ever allocates its own members.
    ``precision`` is ``"f32"`` (default), ``"bf16"`` or ``"f16"``, as for
    ``create_train_state``: members compute in that dtype and keep float32
    parameters; with ``"f16"`` each member carries its own dynamic loss scale.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 4)
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> state = ensemble.create_ensemble_state(model, optax.sgd(0.1), layout)
        >>> kernels = meshkit.to_host(state.params["kernel"])
        >>> kernels.shape, bool(np.allclose(kernels[0], kernels[1]))
        ((4, 5, 3), False)
    """
    policy = Precision.of(precision)
    return jax.jit(
        lambda: _init_ensemble(model, tx, layout.num_members, seed, policy),
        out_shardings=layout.state_sharding,  # a prefix: every leaf P('ensemble')
    )()


def num_members_of(state: TrainState) -> int:
    """K, read from the leading axis of an ensemble state's leaves (checked to agree)."""
    first_leaf: dict[int | None, str] = {}  # leading size -> the first leaf that has it
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape = tuple(getattr(leaf, "shape", ()))
        first_leaf.setdefault(int(shape[0]) if shape else None, jax.tree_util.keystr(path))
    sizes = [size for size in first_leaf if size is not None]
    if len(first_leaf) != 1 or not sizes:
        raise ValueError(
            "Expected an ensemble state whose every leaf has the same leading member axis "
            f"(from create_ensemble_state); leading sizes and a leaf with each: {first_leaf} "
            "(None: a scalar leaf)."
        )
    return sizes[0]


def _mesh_of(state: TrainState) -> Mesh:
    sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        raise TypeError(
            "member_state needs an ensemble state placed on a mesh (from "
            f"create_ensemble_state or a restore); its first leaf has sharding {sharding!r}."
        )
    return sharding.mesh


@functools.lru_cache(maxsize=16)
def _take_member(mesh: Mesh) -> Any:
    def take_member(state: TrainState, index: jax.Array) -> TrainState:
        return jax.tree.map(
            lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), state
        )

    # One compile for every index: the index is an argument, not a constant.
    return jax.jit(take_member, out_shardings=replicated_sharding(mesh))


def member_state(state: TrainState, index: int) -> TrainState:
    """Member ``index`` of an ensemble, as an ordinary train state replicated on the mesh.

    The result has no member axis: it works with ``meshkit.train.make_train_step``,
    ``meshkit.evaluate.full_eval`` with ``meshkit.train.classification_metrics``, and
    ``meshkit.to_host`` for export. With several processes every process must call it
    (the member is gathered from the devices that hold it).

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> from meshkit import ensemble, train
        >>> layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 4)
        >>> model = train.linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> state = ensemble.create_ensemble_state(model, optax.sgd(0.1), layout)
        >>> member = ensemble.member_state(state, 2)
        >>> member.params["kernel"].shape, int(member.step)
        ((5, 3), 0)
    """
    num_members = num_members_of(state)
    index = check_int(index, name="Member index")
    if not 0 <= index < num_members:
        raise ValueError(
            f"Member index {index!r} is out of range: the ensemble has {num_members} members, "
            f"numbered 0 to {num_members - 1}."
        )
    return _take_member(_mesh_of(state))(state, jnp.int32(int(index)))
