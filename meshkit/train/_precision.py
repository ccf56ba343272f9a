"""Mixed precision: float32 parameters and optimizer state, compute in bfloat16 or float16.

The policy is the one of Flax's ImageNet example, MaxText and Keras 3: the train state
keeps float32 parameters and optimizer moments; the forward and backward passes run
on a copy of the parameters (and the inputs) cast to the compute dtype; the model's
outputs come back as float32, so losses and metrics are reduced in float32; the
gradients, taken with respect to the float32 parameters, are float32. Float16's narrow
range needs dynamic loss scaling: the loss is multiplied by a scale before the
backward pass and the gradients divided by it; a step whose gradients overflow is
skipped and the scale halved, and after ``growth_interval`` good steps it doubles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

PrecisionName = Literal["f32", "bf16", "f16"]

_DTYPES: dict[str, Any] = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """Which dtype the model computes in; parameters and optimizer state stay float32.

    Attributes:
      name: ``"f32"`` (everything float32), ``"bf16"`` (bfloat16 compute) or ``"f16"``
        (float16 compute with dynamic loss scaling).
      initial_loss_scale: the first loss scale (``"f16"`` only); a power of two.
      growth_interval: finite steps after which the loss scale doubles (``"f16"`` only).

    Examples:
        >>> import jax.numpy as jnp
        >>> policy = Precision("bf16")
        >>> policy.to_compute({"w": jnp.ones(2), "count": jnp.ones(2, jnp.int32)})["w"].dtype
        dtype(bfloat16)
        >>> policy.to_output(jnp.ones(2, jnp.bfloat16)).dtype
        dtype('float32')
        >>> Precision("f16").loss_scaling, Precision("bf16").loss_scaling
        (True, False)
    """

    name: PrecisionName = "f32"
    initial_loss_scale: float = 2.0**15
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise ValueError(
                f"precision must be one of {sorted(_DTYPES)} (float32, bfloat16 or float16 "
                f"compute), got {self.name!r}."
            )
        if not self.initial_loss_scale >= 1 or self.growth_interval < 1:
            raise ValueError(
                "initial_loss_scale must be >= 1 and growth_interval >= 1, got "
                f"{self.initial_loss_scale} and {self.growth_interval}."
            )

    @classmethod
    def of(cls, value: Precision | str | None) -> Precision:
        """``value`` as a ``Precision`` (``None``: float32)."""
        if value is None:
            return cls()
        if isinstance(value, Precision):
            return value
        return cls(value)  # pyright: ignore[reportArgumentType]  # checked in __post_init__

    @property
    def compute_dtype(self) -> Any:
        """The dtype the forward and backward passes run in."""
        return _DTYPES[self.name]

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled dynamically (float16 compute)."""
        return self.name == "f16"

    def initial_scale(self) -> LossScale | None:
        """A fresh loss-scaling state for the train state, or ``None`` without float16."""
        if not self.loss_scaling:
            return None
        return LossScale.initial(self.initial_loss_scale, growth_interval=self.growth_interval)

    def to_compute(self, tree: Any) -> Any:
        """``tree`` with its float32 leaves cast to the compute dtype (others unchanged)."""
        if self.name == "f32":
            return tree
        return jax.tree.map(lambda leaf: _cast(leaf, jnp.float32, self.compute_dtype), tree)

    def to_output(self, tree: Any) -> Any:
        """``tree`` with its compute-dtype leaves cast back to float32."""
        if self.name == "f32":
            return tree
        return jax.tree.map(lambda leaf: _cast(leaf, self.compute_dtype, jnp.float32), tree)


def _cast(leaf: Any, source: Any, target: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return leaf.astype(target) if dtype == source else leaf


class LossScale(struct.PyTreeNode):
    """Dynamic loss scaling state for float16 compute (part of the train state).

    Attributes:
      scale: the factor the loss is multiplied by before the backward pass.
      good_steps: finite steps since the scale last changed.
      growth_interval: finite steps after which the scale doubles (static).

    Examples:
        >>> scale = LossScale.initial(2.0**15, growth_interval=2)
        >>> scale = scale.adjust(jnp.asarray(False))  # an overflow halves it
        >>> float(scale.scale), int(scale.good_steps)
        (16384.0, 0)
        >>> scale = scale.adjust(jnp.asarray(True)).adjust(jnp.asarray(True))
        >>> float(scale.scale), int(scale.good_steps)
        (32768.0, 0)
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = struct.field(pytree_node=False, default=2000)

    @classmethod
    def initial(cls, scale: float = 2.0**15, *, growth_interval: int = 2000) -> LossScale:
        """A fresh state: ``scale`` (float16's largest power of two by default)."""
        return cls(
            scale=jnp.asarray(scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            growth_interval=growth_interval,
        )

    def adjust(self, finite: jax.Array) -> LossScale:
        """The state after a step whose gradients were ``finite`` (or overflowed)."""
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, jnp.minimum(self.scale * 2, jnp.finfo(jnp.float32).max), self.scale),
            jnp.maximum(self.scale / 2, 1.0),
        )
        good_steps = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good_steps.astype(jnp.int32))
