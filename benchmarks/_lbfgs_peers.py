"""The peers meshkit.lbfgs is measured against, each as its authors recommend running it.

- ``jaxopt.LBFGS(...).run`` under ``jax.jit``: jaxopt's own loop, one program;
- ``optax.lbfgs()`` stepped in a jitted ``lax.while_loop`` with
  ``optax.value_and_grad_from_state`` (the optax documentation's L-BFGS loop).

Both minimise the same objective as ``meshkit.lbfgs.multiclass_logreg`` with no L2:
the mean softmax cross-entropy of a linear model, from zero weights to a gradient
norm of at most ``tol``. Each returns ``(value, grad_norm, iterations, evaluations)``
as arrays, so a caller blocks on them once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxopt
import optax

Result = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def mean_logreg(w: jax.Array, data: tuple[jax.Array, jax.Array]) -> jax.Array:
    """The mean softmax cross-entropy of ``x @ w`` (jaxopt's ``multiclass_logreg``)."""
    return jaxopt.objective.multiclass_logreg(w, data)


def jaxopt_run(*, tol: float, max_steps: int) -> Callable[[Any, Any], Result]:
    """``jaxopt.LBFGS(...).run`` under ``jax.jit``, the notebook's settings otherwise."""
    solver = jaxopt.LBFGS(
        fun=mean_logreg, tol=tol, maxiter=max_steps, stepsize=0.0, linesearch="zoom"
    )

    @jax.jit
    def run(w0: jax.Array, data: Any) -> Result:
        _, state = solver.run(w0, data=data)
        return state.value, state.error, state.iter_num, state.num_fun_eval

    return run


def optax_loop(*, tol: float, max_steps: int) -> Callable[[Any, Any], Result]:
    """``optax.lbfgs()`` in a jitted ``while_loop`` until ``||g|| <= tol``."""
    optimizer = optax.lbfgs()

    @jax.jit
    def run(w0: jax.Array, data: Any) -> Result:
        def fun(w: jax.Array) -> jax.Array:
            return mean_logreg(w, data)

        value_and_grad = optax.value_and_grad_from_state(fun)

        def step(carry: tuple[Any, Any, jax.Array]) -> tuple[Any, Any, jax.Array]:
            w, state, evaluations = carry
            value, grad = value_and_grad(w, state=state)
            updates, state = optimizer.update(grad, state, w, value=value, grad=grad, value_fn=fun)
            searched = optax.tree.get(state, "num_linesearch_steps")
            return optax.apply_updates(w, updates), state, evaluations + searched

        def running(carry: tuple[Any, Any, jax.Array]) -> jax.Array:
            _, state, _ = carry
            count = optax.tree.get(state, "count")
            norm = optax.tree.norm(optax.tree.get(state, "grad"))
            return (count == 0) | ((count < max_steps) & (norm > tol))

        # value_and_grad_from_state evaluates once at the start; then every line-search
        # trial is one evaluation, and its last one is reused by the next step.
        start = (w0, optimizer.init(w0), jnp.ones((), jnp.int32))
        _, state, evaluations = jax.lax.while_loop(running, step, start)
        value = optax.tree.get(state, "value")
        norm = optax.tree.norm(optax.tree.get(state, "grad"))
        return value, norm, optax.tree.get(state, "count"), evaluations

    return run
