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
import optax

from meshkit.lbfgs._linesearch import LineSearchResult, zoom_linesearch
from meshkit.lbfgs._objective import ValueAndGrad
from meshkit.lbfgs._status import Status


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
      sy_products: ``s_i · y_j`` for every two slots of the history, ``[m, m]``: updated
        one row and column per stored pair, so the product with the inverse Hessian
        never recomputes them.
      yy_products: ``y_i · y_j`` likewise.
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
    sy_products: jax.Array
    yy_products: jax.Array
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
    norm = optax.tree.norm(grad)
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
        sy_products=jnp.zeros((m, m), value.dtype),
        yy_products=jnp.zeros((m, m), value.dtype),
        newest=jnp.asarray(m - 1, jnp.int32),
        num_pairs=jnp.zeros((), jnp.int32),
        step_size=jnp.ones((), value.dtype),
        iteration=jnp.zeros((), jnp.int32),
        num_evaluations=jnp.ones((), jnp.int32),
        status=status,
        value_history=nan.at[0].set(value),
        grad_norm_history=nan.at[0].set(norm.astype(value.dtype)),
    )


def _history_projection(history: Any, vector: Any) -> jax.Array:
    """``h_i · vector`` for every row ``h_i`` of a stacked pytree, as ``[k]``."""
    products = [
        jnp.tensordot(h, v, axes=v.ndim)
        for h, v in zip(jax.tree.leaves(history), jax.tree.leaves(vector), strict=True)
    ]
    return sum(products[1:], start=products[0])


def _history_combination(history: Any, weights: jax.Array) -> Any:
    """``sum_i weights_i h_i`` over the rows of a stacked pytree."""
    return jax.tree.map(lambda h: jnp.tensordot(weights.astype(h.dtype), h, axes=1), history)


def inverse_hessian_product(state: LBFGSState, vector: Any) -> Any:
    """``H @ vector`` for the L-BFGS inverse-Hessian estimate, in the compact form.

    Byrd, Nocedal and Schnabel (1994): with the pairs as matrices ``S`` and ``Y``
    (oldest first), ``R`` the upper triangle of ``Sᵀ Y``, ``D`` its diagonal and
    ``γ = sᵀy / yᵀy`` of the newest pair, ``H v = γ v + S R⁻ᵀ ((D + γ YᵀY) p - γ Yᵀv)
    - γ Y p`` with ``p = R⁻¹ Sᵀv``. ``Sᵀ Y`` and ``Yᵀ Y`` come from the state; the
    history enters through two projections and two combinations, the rest is
    ``m × m`` algebra. The two-loop recursion gives the same vector with ``4 m``
    dependent dot products.
    """
    m = state.sy_products.shape[0]
    # Position i (oldest first) of the ring buffer, and which positions hold a pair.
    slots = (state.newest + 1 + jnp.arange(m)) % m
    valid = jnp.arange(m) >= m - state.num_pairs
    both = valid[:, None] & valid[None, :]
    sy = state.sy_products[slots][:, slots]
    yy = state.yy_products[slots][:, slots]
    s_v = jnp.where(valid, _history_projection(state.s_history, vector)[slots], 0)
    y_v = jnp.where(valid, _history_projection(state.y_history, vector)[slots], 0)
    newest = m - 1
    gamma = jnp.where(state.num_pairs > 0, sy[newest, newest] / yy[newest, newest], 1.0)
    # Empty positions become an identity block, decoupled from the stored pairs.
    r = jnp.where(both, jnp.triu(sy), jnp.eye(m, dtype=sy.dtype))
    d = jnp.where(valid, jnp.diagonal(sy), 0)
    p = jax.scipy.linalg.solve_triangular(r, s_v, lower=False)
    middle = d * p + gamma * (jnp.where(both, yy, 0) @ p) - gamma * y_v
    s_weights = jax.scipy.linalg.solve_triangular(r, middle, trans=1, lower=False)
    # Back from age order to ring-buffer slots.
    s_weights = jnp.zeros_like(s_weights).at[slots].set(s_weights)
    y_weights = jnp.zeros_like(p).at[slots].set(-gamma * p)
    return jax.tree.map(
        lambda v, s, y: (gamma * v + s + y).astype(v.dtype),
        vector,
        _history_combination(state.s_history, s_weights),
        _history_combination(state.y_history, y_weights),
    )


def _store(history: Any, slot: jax.Array, new: Any, keep: jax.Array) -> Any:
    """Writes ``new`` into ``slot`` when ``keep``: one row touched, not the whole buffer."""
    return jax.tree.map(
        lambda h, n: h.at[slot].set(jnp.where(keep, n.astype(h.dtype), h[slot])), history, new
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
        (search.unbounded, Status.UNBOUNDED),
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
    """One iteration: direction from the compact product, line search, pair update."""
    direction = jax.tree.map(jnp.negative, inverse_hessian_product(state, state.grad))
    slope = jnp.asarray(optax.tree.vdot(state.grad, direction))
    descent = jnp.isfinite(slope) & (slope < 0)
    # Not a descent direction (rounding in a badly conditioned history): forget the
    # pairs and take steepest descent.
    direction = jax.tree.map(lambda d, g: jnp.where(descent, d, -g), direction, state.grad)
    num_pairs = jnp.where(descent, state.num_pairs, 0)
    grad_norm = optax.tree.norm(state.grad)
    # With pairs, the scaled quasi-Newton step has unit length. Without (the first
    # iteration), try a step of unit length in parameter space; after forgetting the
    # pairs, the newest pair's curvature scale (the history's own first guess).
    newest_scale = (
        state.sy_products[state.newest, state.newest]
        / state.yy_products[state.newest, state.newest]
    )
    usable_scale = (state.num_pairs > 0) & jnp.isfinite(newest_scale) & (newest_scale > 0)
    initial_step = jnp.where(
        num_pairs > 0, 1.0, jnp.where(usable_scale, newest_scale, 1.0 / grad_norm)
    ).astype(state.value.dtype)
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
    sy, yy = jnp.asarray(optax.tree.vdot(s, y)), jnp.asarray(optax.tree.vdot(y, y))
    m = state.sy_products.shape[0]
    slot = (state.newest + 1) % m
    # The new pair's products with every stored pair (its own slot: with itself).
    s_y = _history_projection(state.s_history, y).at[slot].set(sy)
    y_s = _history_projection(state.y_history, s).at[slot].set(sy)
    y_y = _history_projection(state.y_history, y).at[slot].set(yy)
    # Keep the pair when the curvature is positive and its products are finite. The
    # products' part also orders the reads of the old history before the in-place
    # write of the new row, so XLA need not copy the history every iteration.
    finite = jnp.isfinite(jnp.sum(s_y) + jnp.sum(y_s) + jnp.sum(y_y))
    # Positive curvature, judged by the angle between s and y (scale-free): a steep
    # objective's pairs have a tiny sᵀy/yᵀy and are still good ones.
    ss = jnp.asarray(optax.tree.vdot(s, s))
    curved = sy > jnp.finfo(state.value.dtype).eps * jnp.sqrt(ss) * jnp.sqrt(yy)
    keep = search.found & curved & finite
    sy_products = state.sy_products.at[:, slot].set(s_y).at[slot, :].set(y_s)
    yy_products = state.yy_products.at[:, slot].set(y_y).at[slot, :].set(y_y)
    iteration = state.iteration + search.found.astype(jnp.int32)
    norm = optax.tree.norm(search.grad)
    dtype = search.value.dtype
    return LBFGSState(
        params=search.params,
        value=search.value,
        grad=search.grad,
        s_history=_store(state.s_history, slot, s, keep),
        y_history=_store(state.y_history, slot, y, keep),
        sy_products=jnp.where(keep, sy_products, state.sy_products),
        yy_products=jnp.where(keep, yy_products, state.yy_products),
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
