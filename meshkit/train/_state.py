"""The train state, and building it sharded without materialising it on one device."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from meshkit._logical import (
    ActivationRules,
    Names,
    leaf_names,
    split_axes_collections,
    table_axis_names,
    unbox,
)
from meshkit._mesh import DATA_AXIS
from meshkit._pytree import path_str
from meshkit._rules import PartitionRules, infer_shardings, logger
from meshkit._specs import spec_axis_names
from meshkit.train._precision import LossScale, Precision

Variables = dict[str, Any]
"""Model variables by collection: ``{"params": ..., "batch_stats": ...}``."""

InitFn = Callable[[jax.Array], Variables]
ApplyFn = Callable[..., Any]
"""``apply(variables, inputs, *, train, rngs, mutable)`` in Flax linen's convention."""


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as two pure functions, whatever library defined it.

    Attributes:
      init: ``init(rng) -> variables`` (``{"params": ..., other collections...}``).
      apply: ``apply(variables, inputs, *, train, rngs, mutable)``; with a non-empty
        ``mutable`` list it returns ``(outputs, updated_collections)``, like linen.
      devices: for a model wrapped by ``per_device``, the number of devices it splits
        every batch over; 0 for a model that runs on the whole batch.
    """

    init: InitFn
    apply: ApplyFn
    devices: int = 0


def linen_model(module: nn.Module, sample_input: Any) -> Model:
    """Adapts a Flax linen module; ``sample_input`` only fixes shapes for ``init``.

    Modules whose ``__call__`` takes ``train`` get it (dropout and batch norm switch
    on in training); modules without it, like the nets of the Flax ensembling HOWTO
    and the cluster wiki's Flax page, run unchanged.

    Examples:
        >>> import jax.numpy as jnp
        >>> from meshkit.models import CifarNet
        >>> model = linen_model(CifarNet(), jnp.zeros((1, 32, 32, 3)))
        >>> sorted(model.init(jax.random.key(0)))
        ['params']
    """

    takes_train = "train" in inspect.signature(type(module).__call__).parameters
    mode = (lambda train: {"train": train}) if takes_train else (lambda train: {})

    def init(rng: jax.Array) -> Variables:
        variables = module.init({"params": rng, "dropout": rng}, sample_input, **mode(False))
        return dict(variables)

    def apply(
        variables: Variables,
        inputs: Any,
        *,
        train: bool = False,
        rngs: Mapping[str, jax.Array] | None = None,
        mutable: Any = False,
    ) -> Any:
        rng_dict = dict(rngs) if rngs is not None else None
        return module.apply(variables, inputs, rngs=rng_dict, mutable=mutable, **mode(train))

    return Model(init=init, apply=apply)


def nnx_model(factory: Callable[[Any], Any]) -> Model:
    """Adapts a Flax NNX model: ``factory(rngs)`` builds it (``rngs`` is an ``nnx.Rngs``).

    The NNX state is split into ``params`` (``nnx.Param``) and ``state`` (everything
    else: batch-norm statistics, the counters of the model's own RNG streams, which
    dropout draws from); ``apply`` merges them back for each call and returns the
    updated ``state``, so it is checkpointed and resumed like linen's ``batch_stats``.

    Variables annotated with ``nnx.with_partitioning(init, ("embed", "mlp"))`` keep
    their names as metadata, read by ``PartitionRules(logical=...)``; they are created
    without NNX's eager sharding (which needs a mesh at creation): the train state is
    placed by ``create_train_state`` instead.

    Examples:
        >>> from flax import nnx
        >>> model = nnx_model(lambda rngs: nnx.Linear(3, 2, rngs=rngs))
        >>> sorted(model.init(jax.random.key(0)))
        ['params', 'state']
    """
    from flax import nnx

    def build(rngs: Any) -> Any:
        eager = getattr(nnx, "use_eager_sharding", None)  # flax >= 0.12
        with contextlib.nullcontext() if eager is None else eager(False):
            return factory(rngs)

    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))), nnx.Param, ...)

    def init(rng: jax.Array) -> Variables:
        _, params, rest = nnx.split(build(nnx.Rngs(rng)), nnx.Param, ...)
        return {"params": params, "state": rest}

    def apply(
        variables: Variables,
        inputs: Any,
        *,
        train: bool = False,
        rngs: Mapping[str, jax.Array] | None = None,
        mutable: Any = False,
    ) -> Any:
        # Fresh Variable objects at this trace level: NNX refuses to mutate a variable
        # (batch statistics, RNG counts) created at another one.
        params, rest = jax.tree.map(
            lambda leaf: leaf, (variables["params"], variables.get("state", nnx.State({})))
        )
        module = nnx.merge(graphdef, params, rest)
        module.train() if train else module.eval()
        del rngs  # NNX modules carry their RNG streams in their state (checkpointed with it)
        outputs = module(inputs)
        if not mutable:
            return outputs
        _, _, rest = nnx.split(module, nnx.Param, ...)
        return outputs, {"state": rest}

    return Model(init=init, apply=apply)


class TrainState(struct.PyTreeNode):
    """Everything a training step reads and writes.

    Attributes:
      step: number of steps taken (a scalar array).
      params: trainable parameters.
      opt_state: the optimizer's state.
      collections: mutable model variables other than params (``batch_stats``...).
      rng: the base key; step ``s`` uses ``fold_in(rng, s)`` for dropout, so a resumed
        run draws the same randomness.
      apply_fn: the model's apply function (static).
      tx: the optax optimizer (static).
      loss_scale: the dynamic loss scale with float16 compute, else ``None``.
      precision: the compute dtype policy (static); parameters stay float32.
      param_axes: the logical axis names the model gave its parameters, as
        ``(path under params, names)`` pairs (static; empty for an unannotated model).
      activation_rules: the logical table and mesh that ``nn.with_logical_constraint``
        resolves against while train and eval steps trace (static; ``None`` unless
        ``create_train_state`` got rules with a logical table).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    collections: dict[str, Any]
    rng: jax.Array
    apply_fn: ApplyFn = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    loss_scale: LossScale | None = None
    precision: Precision = struct.field(pytree_node=False, default=Precision())
    param_axes: tuple[tuple[str, Names], ...] = struct.field(pytree_node=False, default=())
    activation_rules: ActivationRules | None = struct.field(pytree_node=False, default=None)

    def variables(self, params: Any | None = None) -> Variables:
        """The variables ``apply_fn`` takes: params (these, or the state's) and collections."""
        return {"params": self.params if params is None else params, **self.collections}

    def step_rng(self) -> jax.Array:
        """This step's dropout key, ``fold_in(rng, step)``: a resumed run draws the same."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

    def logical_axes(self) -> TrainState:
        """The logical axis names of every leaf (a tuple of names, or ``None``), state-shaped.

        Parameters carry the names their model gave them (``param_axes``); so do the
        optimizer-state leaves that mirror a parameter (same path suffix and shape, as
        Adam's ``mu`` and ``nu``), so the logical table shards them alike.

        Examples:
            >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
            >>> init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
            >>> model = linen_model(nn.Dense(8, kernel_init=init), jnp.zeros((1, 4)))
            >>> rules = meshkit.PartitionRules(logical={"embed": None, "mlp": "data"})
            >>> mesh = meshkit.make_mesh("data=-1")
            >>> state = create_train_state(model, optax.adam(0.1), mesh, rules=rules)
            >>> state.param_axes
            (('kernel', ('embed', 'mlp')),)
            >>> state.logical_axes().opt_state[0].mu["kernel"]
            ('embed', 'mlp')
            >>> state.opt_state[0].mu["kernel"].sharding.spec
            P(None, 'data')
        """
        by_path = dict(self.param_axes)
        shapes = {
            path_str(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(self.params)
        }

        def names_of(path: str, shape: tuple[int, ...]) -> Names | None:
            parts = path.split("/")
            for start in range(len(parts)):  # the longest suffix that is a parameter's path
                suffix = "/".join(parts[start:])
                names = by_path.get(suffix)
                if names is not None:  # a stacked (vmapped) state has one more dimension
                    same = shapes.get(suffix) == shape and len(names) == len(shape)
                    return names if same else None
            return None

        leaves, structure = jax.tree_util.tree_flatten_with_path(self)
        names = [names_of(path_str(path), tuple(leaf.shape)) for path, leaf in leaves]
        return jax.tree.unflatten(structure, names)

    def logical_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The activation rules' context while a step traces (nothing without rules)."""
        rules = self.activation_rules
        return contextlib.nullcontext() if rules is None else rules.scope()

    def apply_gradients(
        self, grads: Any, collections: Mapping[str, Any] | None = None
    ) -> TrainState:
        """One optimizer update; ``collections`` replaces the mutable collections."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            collections=dict(self.collections if collections is None else collections),
        )


def _init_state(
    model: Model, tx: optax.GradientTransformation, seed: int, precision: Precision
) -> TrainState:
    return init_state_from_key(model, tx, jax.random.key(seed), precision=precision)


def init_state_from_key(
    model: Model,
    tx: optax.GradientTransformation,
    key: jax.Array,
    *,
    precision: Precision | str | None = None,
) -> TrainState:
    """A fresh train state from ``key``, split into the init key and the dropout key.

    The un-placed building block of ``create_train_state`` (which calls it with
    ``jax.random.key(seed)`` under a jit with the state's shardings), for use inside
    transformations: ``jax.lax.map`` or ``jax.vmap`` over keys builds stacked states,
    as ``meshkit.ensemble.create_ensemble_state`` does.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
        >>> model = linen_model(nn.Dense(3), jnp.zeros((1, 5)))
        >>> keys = jax.random.split(jax.random.key(0), 2)
        >>> states = jax.vmap(lambda key: init_state_from_key(model, optax.sgd(0.1), key))(keys)
        >>> states.params["kernel"].shape, states.step.tolist()
        ((2, 5, 3), [0, 0])
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"tx must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), got "
            f"{type(tx).__name__}: {tx!r}."
        )
    policy = Precision.of(precision)
    init_rng, train_rng = jax.random.split(key)
    variables, axes_names = split_axes_collections(model.init(init_rng))
    params, names = leaf_names(variables["params"])
    paths = [path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    names = [axes_names.get(path) if n is None else n for path, n in zip(paths, names, strict=True)]
    param_axes = tuple((path, n) for path, n in zip(paths, names, strict=True) if n is not None)
    variables = unbox({key: value for key, value in variables.items() if key != "params"})
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        collections=variables,
        rng=jax.random.key_data(train_rng),
        apply_fn=model.apply,
        tx=tx,
        loss_scale=policy.initial_scale(),
        precision=policy,
        param_axes=param_axes,
    )


def abstract_train_state(
    model: Model,
    tx: optax.GradientTransformation,
    seed: int = 0,
    *,
    precision: Precision | str | None = None,
    mesh: Mesh | None = None,
    rules: PartitionRules | None = None,
) -> TrainState:
    """The train state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), without any FLOPs.

    With a ``mesh``, every leaf also carries the sharding ``create_train_state`` would
    give it under ``rules``, and the state carries the activation rules of a logical
    table, exactly as a placed state does: a train step lowers and compiles on it
    (``step.lower(abstract, batch).compile()``) with nothing allocated, which is how
    ``meshkit.plan`` sizes a model for a pod it does not have.

    Examples:
        >>> import jax.numpy as jnp, optax, flax.linen as nn, meshkit
        >>> model = linen_model(nn.Dense(4096), jnp.zeros((1, 4096)))
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> state = abstract_train_state(model, optax.adam(1e-3), mesh=mesh,
        ...                              rules=meshkit.PartitionRules.fsdp())
        >>> kernel = state.params["kernel"]
        >>> type(kernel).__name__, kernel.shape, type(kernel.sharding).__name__
        ('ShapeDtypeStruct', (4096, 4096), 'NamedSharding')
    """
    policy = Precision.of(precision)
    abstract = jax.eval_shape(lambda: _init_state(model, tx, seed, policy))
    if mesh is None:
        return abstract
    shardings = train_state_shardings(abstract, mesh, rules)
    abstract = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract,
        shardings,
    )
    return _with_activation_rules(abstract, mesh, rules)


def _with_activation_rules(
    state: TrainState, mesh: Mesh, rules: PartitionRules | None
) -> TrainState:
    if rules is None or rules.logical is None:
        return state
    return state.replace(activation_rules=ActivationRules(rules.logical, mesh))


def train_state_shardings(
    abstract: TrainState, mesh: Mesh, rules: PartitionRules | None = None
) -> TrainState:
    """Shardings for every leaf of the train state: replicated, or by ``rules``.

    Rules match paths such as ``params/Dense_0/kernel`` and
    ``opt_state/0/mu/Dense_0/kernel``, so one FSDP rule shards the parameters and
    their optimizer moments alike. The names of annotated parameters
    (``TrainState.logical_axes``) place them and the optimizer moments that mirror
    them: through the logical table of ``rules``, or as mesh axes where a name is one.
    """
    names = abstract.logical_axes() if abstract.param_axes else None
    return infer_shardings(abstract, mesh, rules, names=names)


def create_train_state(
    model: Model,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    rules: PartitionRules | None = None,
    seed: int = 0,
    precision: Precision | str | None = None,
) -> TrainState:
    """Builds the train state directly in its shardings.

    The shapes come from ``jax.eval_shape``, the shardings from ``rules`` (replicated
    when ``None``; ``PartitionRules.fsdp()`` for FSDP), and the state is created by a
    jit with those ``out_shardings``: it never exists in full on one device. That jit
    takes the seed as an argument, so a second state of the same model, optimizer,
    mesh, rules and precision (another seed, a fresh start) compiles nothing.

    ``precision`` (``"f32"``, ``"bf16"``, ``"f16"`` or a ``Precision``) picks the
    dtype the model computes in; parameters and optimizer state stay float32 (see
    ``Precision``). With ``"f16"`` the state also carries a dynamic ``LossScale``.

    Parameters a flax model annotated (``nn.with_logical_partitioning``,
    ``nn.with_partitioning``, ``nnx.with_partitioning``, or the older
    ``flax.linen.partitioning.param_with_axes``) come unboxed, as plain arrays; their
    names go through the logical table of ``rules`` (``PartitionRules(logical=...)``),
    names that are mesh axes mean those axes (as ``nn.with_partitioning`` means them),
    and an annotated parameter that neither places is left to the default with a
    warning naming it. The state keeps the table with the mesh (``activation_rules``)
    so that the train and eval steps made from it resolve
    ``nn.with_logical_constraint`` on activations to the mesh.

    Examples:
        >>> import jax.numpy as jnp, optax, meshkit
        >>> from meshkit.models import CifarNet
        >>> from meshkit.train import create_train_state, linen_model
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> model = linen_model(CifarNet(), jnp.zeros((1, 32, 32, 3)))
        >>> state = create_train_state(model, optax.sgd(0.1), mesh)
        >>> int(state.step), state.params["Dense_0"]["kernel"].shape
        (0, (14400, 120))
    """
    policy = Precision.of(precision)
    abstract = abstract_train_state(model, tx, seed, precision=policy)
    shardings = train_state_shardings(abstract, mesh, rules)
    warn_unused_axes(shardings, mesh, rules)
    if -(2**31) <= seed < 2**32:  # a seed JAX takes as 32 bits: one compile for them all
        leaves, treedef = jax.tree.flatten(shardings)
        init = _init_program(model, tx, policy, (treedef, tuple(leaves)))
        state = init(np.uint32(seed) if seed >= 0 else np.int32(seed))
    else:
        state = jax.jit(lambda: _init_state(model, tx, seed, policy), out_shardings=shardings)()
    return _with_activation_rules(state, mesh, rules)


@functools.lru_cache(maxsize=16)
def _init_program(
    model: Model,
    tx: optax.GradientTransformation,
    policy: Precision,
    shardings: tuple[Any, tuple[Any, ...]],
) -> Callable[[Any], TrainState]:
    """The jitted init of ``create_train_state``, the seed its argument: one compile for
    every seed of the same model, optimizer, precision and shardings."""
    treedef, leaves = shardings
    return jax.jit(
        lambda seed: init_state_from_key(model, tx, jax.random.key(seed), precision=policy),
        out_shardings=jax.tree.unflatten(treedef, leaves),
    )


_WARNED_UNUSED: set[tuple[tuple[tuple[str, int], ...], str]] = set()
_BATCH_AXES = (DATA_AXIS, "ensemble", "fsdp")  # axes a batch is usually split over
_COMMON_AXES = ("data", "model", "fsdp", "tensor", "expert", "seq", "ensemble", "pipeline")


def warn_unused_axes(shardings: Any, mesh: Mesh, rules: PartitionRules | None) -> None:
    """Warns once for each mesh axis (size > 1) that no leaf of ``shardings`` uses, that
    ``rules``' logical table does not name and that does not usually carry the batch:
    every device along it would repeat the same work."""
    used: set[str] = set(_BATCH_AXES)
    for sharding in jax.tree.leaves(shardings):
        used.update(spec_axis_names(getattr(sharding, "spec", ())))
    if rules is not None and rules.logical is not None:
        used.update(table_axis_names(rules.logical))
    shape = tuple(mesh.shape.items())
    for axis, size in shape:
        if size == 1 or axis in used or (shape, axis) in _WARNED_UNUSED:
            continue
        _WARNED_UNUSED.add((shape, axis))
        close = difflib.get_close_matches(axis, [*mesh.shape, *_COMMON_AXES], n=2, cutoff=0.6)
        close = [name for name in close if name != axis]
        hint = f"; a typo for {close[0]!r}?" if close else ""
        logger.warning(
            "Mesh axis %r (size %d%s) of the mesh %s places no parameter or optimizer state "
            "and is not a batch axis: its %d devices would each repeat the same work. Shard "
            "parameters over it (PartitionRules, a logical table, nn.with_partitioning) or "
            "leave it out of the mesh.",
            axis,
            size,
            hint,
            dict(mesh.shape),
            size,
        )


def state_shardings_of(state: TrainState) -> TrainState:
    """The sharding of every leaf of a placed train state."""
    return jax.tree.map(lambda leaf: leaf.sharding, state)
