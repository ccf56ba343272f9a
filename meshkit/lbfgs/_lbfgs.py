"""The L-BFGS iteration as pure state transitions: ``init``, ``step`` and ``run``.

Every decision (descent check, step acceptance, curvature-pair update, stopping)
reads scalars computed from the value and gradient after their all-reduce over the
data axis: the same bits on every device of every process, so the replicated
iterates can never diverge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshkit.lbfgs._linesearch import LineSearchResult, zoom_linesearch
from meshkit.lbfgs._objective import ValueAndGrad
from meshkit.lbfgs._status import Status
from meshkit.lbfgs._tree import tree_axpy, tree_norm, tree_scale, tree_vdot


class LBFGSState(NamedTuple):
    """Everything one L-BFGS iteration reads and writes: a pytree of arrays.

    It can be saved mid-solve (``meshkit.to_host`` then ``np.savez``, or Orbax) and
    put back with ``LBFGS.load_state``; continuing from it reproduces the
    uninterrupted trajectory.

    Attributes:
      params: the current iterate.
      value: the objective at ``params``.
      grad: its gradient.
      s_history: the last ``history_size`` parameter changes, leaves ``[m, ...]``
        (a ring buffer).
      y_history: the matching gradient changes.
      rho_history: ``1 / <s, y>`` for each stored pair, ``[m]``.
      newest: the ring-buffer slot of the newest pair.
      num_pairs: how many pairs are stored (at most ``m``).
      step_size: the last accepted line-search step.
      iteration: iterations taken (accepted steps).
      num_evaluations: evaluations of the value and gradient so far.
      status: a ``Status`` code; ``0`` (``RUNNING``) while the solver can step.
      value_history: ``value`` after each iteration, ``[max_steps + 1]``; nan beyond
        ``iteration``.
      grad_norm_history: the gradient norm after each iteration, likewise.
    """

    params: Any
    value: jax.Array
    grad: Any
    s_history: Any
    y_history: Any
    rho_history: jax.Array
    newest: jax.Array
    num_pairs: jax.Array
    step_size: jax.Array
    iteration: jax.Array
    num_evaluations: jax.Array
    status: jax.Array
    value_history: jax.Array
    grad_norm_history: jax.Array


@dataclasses.dataclass(frozen=True)
class Options:
    """The solver settings the iteration reads (see ``LBFGS`` for their meaning)."""

    tol: float
    rtol: float
    max_steps: int
    history_size: int
    max_linesearch_steps: int
    c1: float
    c2: float


def _code(status: Status) -> jax.Array:
    return jnp.asarray(int(status), jnp.int32)


def init(value_and_grad: ValueAndGrad, params: Any, options: Options) -> LBFGSState:
    """Evaluates the objective at ``params`` and returns the state before the first step."""
    value, grad = value_and_grad(params)
    norm = tree_norm(grad)
    m = options.history_size
    empty = jax.tree.map(lambda leaf: jnp.zeros((m, *leaf.shape), leaf.dtype), params)
    status = jnp.where(
        ~jnp.isfinite(value) | ~jnp.isfinite(norm),
        _code(Status.NONFINITE),
        jnp.where(norm <= options.tol, _code(Status.GRADIENT_TOLERANCE), _code(Status.RUNNING)),
    )
    nan = jnp.full((options.max_steps + 1,), jnp.nan, value.dtype)
    return LBFGSState(
        params=params,
        value=value,
        grad=grad,
        s_history=empty,
        y_history=empty,
        rho_history=jnp.zeros((m,), value.dtype),
        newest=jnp.asarray(m - 1, jnp.int32),
        num_pairs=jnp.zeros((), jnp.int32),
        step_size=jnp.ones((), value.dtype),
        iteration=jnp.zeros((), jnp.int32),
        num_evaluations=jnp.ones((), jnp.int32),
        status=status,
        value_history=nan.at[0].set(value),
        grad_norm_history=nan.at[0].set(norm.astype(value.dtype)),
    )


def _pair(history: Any, slot: jax.Array) -> Any:
    return jax.tree.map(lambda leaf: leaf[slot], history)


def inverse_hessian_product(state: LBFGSState, vector: Any) -> Any:
    """``H @ vector`` for the L-BFGS inverse-Hessian estimate (the two-loop recursion)."""
    m = state.rho_history.shape[0]
    ages = jnp.arange(m)  # 0 is the newest pair
    slots = (state.newest - ages) % m
    valid = ages < state.num_pairs

    def newest_first(q: Any, age: jax.Array) -> tuple[Any, jax.Array]:
        slot = slots[age]
        alpha = jnp.where(
            valid[age], state.rho_history[slot] * tree_vdot(_pair(state.s_history, slot), q), 0
        )
        return tree_axpy(-alpha, _pair(state.y_history, slot), q), alpha

    q, alphas = jax.lax.scan(newest_first, vector, ages)
    s, y = _pair(state.s_history, state.newest), _pair(state.y_history, state.newest)
    gamma = jnp.where(state.num_pairs > 0, tree_vdot(s, y) / tree_vdot(y, y), 1.0)

    def oldest_first(r: Any, age: jax.Array) -> tuple[Any, None]:
        slot = slots[age]
        beta = jnp.where(
            valid[age], state.rho_history[slot] * tree_vdot(_pair(state.y_history, slot), r), 0
        )
        return tree_axpy(alphas[age] - beta, _pair(state.s_history, slot), r), None

    r, _ = jax.lax.scan(oldest_first, tree_scale(gamma, q), ages[::-1])
    return r


def _store(history: Any, slot: jax.Array, new: Any, keep: jax.Array) -> Any:
    return jax.tree.map(
        lambda h, n: jnp.where(keep, h.at[slot].set(n.astype(h.dtype)), h), history, new
    )


def _status(
    state: LBFGSState, search: LineSearchResult, norm: jax.Array, options: Options
) -> jax.Array:
    found, value = search.found, search.value
    iteration = state.iteration + found.astype(jnp.int32)
    scale = jnp.maximum(jnp.maximum(jnp.abs(state.value), jnp.abs(value)), 1)
    small_decrease = (options.rtol > 0) & (state.value - value <= options.rtol * scale)
    checks = [
        (~found & search.nonfinite, Status.NONFINITE),
        (~found, Status.LINESEARCH_FAILED),
        (~jnp.isfinite(value) | ~jnp.isfinite(norm), Status.NONFINITE),
        (norm <= options.tol, Status.GRADIENT_TOLERANCE),
        (small_decrease, Status.RELATIVE_DECREASE),
        (iteration >= options.max_steps, Status.MAX_STEPS),
    ]
    code = _code(Status.RUNNING)
    for condition, status in reversed(checks):  # the first true check wins
        code = jnp.where(condition, _code(status), code)
    return code


def step(value_and_grad: ValueAndGrad, state: LBFGSState, options: Options) -> LBFGSState:
    """One iteration: direction from the two-loop recursion, line search, pair update."""
    direction = tree_scale(-1.0, inverse_hessian_product(state, state.grad))
    slope = tree_vdot(state.grad, direction)
    descent = jnp.isfinite(slope) & (slope < 0)
    # Not a descent direction (rounding in a badly conditioned history): forget the
    # pairs and take steepest descent.
    direction = jax.tree.map(lambda d, g: jnp.where(descent, d, -g), direction, state.grad)
    num_pairs = jnp.where(descent, state.num_pairs, 0)
    grad_norm = tree_norm(state.grad)
    # With pairs, the scaled quasi-Newton step has unit length; without, try a step of
    # unit length in parameter space.
    initial_step = jnp.where(num_pairs > 0, 1.0, 1.0 / grad_norm).astype(state.value.dtype)
    search = zoom_linesearch(
        value_and_grad,
        params=state.params,
        value=state.value,
        grad=state.grad,
        direction=direction,
        initial_step=initial_step,
        max_evaluations=options.max_linesearch_steps,
        c1=options.c1,
        c2=options.c2,
    )
    s = jax.tree.map(jnp.subtract, search.params, state.params)
    y = jax.tree.map(jnp.subtract, search.grad, state.grad)
    sy, yy = tree_vdot(s, y), tree_vdot(y, y)
    keep = search.found & (sy > jnp.finfo(state.value.dtype).eps * yy)
    m = state.rho_history.shape[0]
    slot = (state.newest + 1) % m
    iteration = state.iteration + search.found.astype(jnp.int32)
    norm = tree_norm(search.grad)
    dtype = search.value.dtype
    return LBFGSState(
        params=search.params,
        value=search.value,
        grad=search.grad,
        s_history=_store(state.s_history, slot, s, keep),
        y_history=_store(state.y_history, slot, y, keep),
        rho_history=jnp.where(keep, state.rho_history.at[slot].set(1 / sy), state.rho_history),
        newest=jnp.where(keep, slot, state.newest),
        num_pairs=jnp.where(keep, jnp.minimum(num_pairs + 1, m), num_pairs),
        step_size=jnp.where(search.found, search.step, state.step_size),
        iteration=iteration,
        num_evaluations=state.num_evaluations + search.evaluations,
        status=_status(state, search, norm, options),
        value_history=state.value_history.at[iteration].set(search.value),
        grad_norm_history=state.grad_norm_history.at[iteration].set(norm.astype(dtype)),
    )


def run(step_fn: Callable[[LBFGSState], LBFGSState], state: LBFGSState, stop_at: Any) -> LBFGSState:
    """Applies ``step_fn`` until a stopping criterion holds or ``iteration`` reaches ``stop_at``.

    Every iteration either is accepted (``iteration`` grows) or sets a failure status,
    so the loop always ends.
    """

    def running(s: LBFGSState) -> jax.Array:
        return (s.status == int(Status.RUNNING)) & (s.iteration < stop_at)

    return jax.lax.while_loop(running, step_fn, state)
