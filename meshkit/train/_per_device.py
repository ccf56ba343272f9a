"""A model run once per device of the data axes, as ``pmap`` ran it: named-axis collectives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshkit._mesh import DATA_AXIS, check_axis_names
from meshkit.train._state import Model, Variables


def per_device(
    model: Model,
    mesh: Mesh,
    *,
    axis_name: str | None = None,
    data_axes: str | Sequence[str] = DATA_AXIS,
) -> Model:
    """``model`` run once per device of the data axes, on that device's rows, as ``pmap`` ran it.

    A ``pmap`` program ran the model on each device's slice of the batch, under an
    axis name its collectives could use: ``nn.BatchNorm(axis_name="batch")``
    averaged its statistics over all devices, and a ``BatchNorm`` without
    ``axis_name`` kept per-device ("ghost") statistics. Under ``jax.jit`` no axis is
    bound, so the first fails (``unbound axis name: batch``) and the second silently
    computes statistics over the whole global batch. This wrapper brings back
    ``pmap``'s semantics inside the jitted step: the batch is split into one block
    of rows per device of ``data_axes`` (the blocks the batch sharding gives each
    device, so the same rows ``pmap`` gave it), the model runs on each block under
    ``jax.vmap(axis_name=axis_name)``, and the blocks stay on their devices.

    - ``axis_name`` given (``"batch"`` in the Flax examples): the model's collectives
      over that name reduce across the devices, and statistics equal the ``pmap``
      program's (and, for ``BatchNorm``, those of the same model without
      ``axis_name`` under a plain jit).
    - A ``BatchNorm`` without ``axis_name`` computes statistics per device, as a
      ``pmap`` run without ``axis_name`` did. The results then depend on the number
      of devices of the data axes, as they did under ``pmap``.

    Updated floating-point collections (running averages) come back averaged over
    the devices (what ``pmap`` programs did before evaluating or checkpointing:
    ``sync_batch_stats``); the average of per-device running averages equals the
    running average of the averaged statistics. Each device's dropout key is the
    step's key folded with its index, as ``shard_prng_key`` gave each device its own.
    Every batch the model sees, in training and evaluation, must split evenly over
    the data axes' devices (meshkit's batches and padded evaluation batches do).

    For models without named-axis collectives and without batch norm, this changes
    nothing but speed: use the plain model.

    Args:
      model: from ``linen_model`` or ``nnx_model``.
      mesh: the mesh the train state lives on.
      axis_name: the name the model's collectives use; ``None`` binds no name (for
        per-device statistics of a model without ``axis_name``).
      data_axes: the mesh axes the batch is split over, as in ``batch_sharding``.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn, meshkit
        >>> from meshkit.train import (classification_loss, create_train_state,
        ...                            linen_model, make_train_step, per_device,
        ...                            state_shardings_of)
        >>> class Net(nn.Module):  # as in a pmap program
        ...     @nn.compact
        ...     def __call__(self, x, train=False):
        ...         x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
        ...         return nn.Dense(10)(x.reshape(len(x), -1))
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> model = per_device(linen_model(Net(), jnp.zeros((1, 4, 4, 1))), mesh,
        ...                    axis_name="batch")
        >>> state = create_train_state(model, optax.sgd(0.1), mesh)
        >>> sharding = meshkit.batch_sharding(mesh)
        >>> step = make_train_step(classification_loss, state_shardings_of(state), sharding)
        >>> batch = meshkit.shard_batch({"image": np.ones((8, 4, 4, 1), np.float32),
        ...                              "label": np.zeros(8, np.int32)}, sharding)
        >>> state, metrics = step(state, batch)
        >>> int(state.step)
        1
    """
    if model.devices:
        raise ValueError(
            f"This model already runs per device (over {model.devices} devices); wrap the "
            "model from linen_model or nnx_model once."
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(f"per_device needs a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a string such as 'batch' or None, got {axis_name!r}.")
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    check_axis_names(mesh, axes, what=f"data_axes={axes}")
    devices = math.prod(mesh.shape[axis] for axis in axes)
    spmd_axis = axes[0] if len(axes) == 1 else axes
    inner = model.apply

    def apply(
        variables: Variables,
        inputs: Any,
        *,
        train: bool = False,
        rngs: Mapping[str, jax.Array] | None = None,
        mutable: Any = False,
    ) -> Any:
        blocks = jax.tree.map(lambda x: _split_rows(x, devices, axes), inputs)

        def run(block: Any, index: jax.Array) -> Any:
            keys = (
                None if rngs is None else {k: jax.random.fold_in(v, index) for k, v in rngs.items()}
            )
            return inner(variables, block, train=train, rngs=keys, mutable=mutable)

        out = jax.vmap(run, axis_name=axis_name, spmd_axis_name=spmd_axis)(
            blocks, jnp.arange(devices)
        )
        outputs, collections = out if mutable else (out, None)
        outputs = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), outputs)
        if not mutable:
            return outputs
        return outputs, jax.tree.map(_average_over_devices, collections)

    return dataclasses.replace(model, apply=apply, devices=devices)


def _split_rows(x: Any, devices: int, axes: tuple[str, ...]) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] % devices:
        raise ValueError(
            f"A model wrapped by per_device splits every batch into one block of rows per "
            f"device of the data axes {axes} ({devices} devices), but got inputs of shape "
            f"{x.shape}. Use batches whose size is a multiple of {devices}."
        )
    return x.reshape(devices, x.shape[0] // devices, *x.shape[1:])


def _average_over_devices(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.mean(0)
    return x[0]  # integer state (NNX RNG counts) is the same on every device
