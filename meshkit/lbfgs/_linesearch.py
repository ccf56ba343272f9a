"""A line search for the strong Wolfe conditions: bracket, then zoom with cubic interpolation.

One ``lax.while_loop``; each trial costs one evaluation of the value and gradient.
The trial steps are chosen from replicated scalars only (values and directional
derivatives after their all-reduce), so every device takes the same branch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from meshkit.lbfgs._objective import ValueAndGrad

MIN_SHRINK = 0.1
"""A zoom trial keeps at least this fraction of the bracket's width from either end."""
EXTRAPOLATE = (1.1, 4.0)
"""While bracketing, the next trial lies this many last-step-lengths beyond the last trial."""
MAX_STEP = 1e10


class LineSearchResult(NamedTuple):
    """The outcome of one line search along ``direction`` from ``params``."""

    step: jax.Array
    params: Any
    value: jax.Array
    grad: Any
    evaluations: jax.Array
    found: jax.Array
    nonfinite: jax.Array
    unbounded: jax.Array


class _Point(NamedTuple):
    step: jax.Array
    value: jax.Array
    slope: jax.Array


class _Search(NamedTuple):
    trial: jax.Array
    lo: _Point
    lo_grad: Any
    hi: _Point
    bracketed: jax.Array
    done: jax.Array
    evaluations: jax.Array
    any_finite: jax.Array


def cubic_minimizer(a: _Point, b: _Point) -> tuple[jax.Array, jax.Array]:
    """The minimiser of the cubic matching values and slopes at ``a`` and ``b``, and validity."""
    theta = a.slope + b.slope - 3 * (a.value - b.value) / (a.step - b.step)
    radicand = theta**2 - a.slope * b.slope
    gamma = jnp.sign(b.step - a.step) * jnp.sqrt(jnp.maximum(radicand, 0))
    step = b.step - (b.step - a.step) * (b.slope + gamma - theta) / (b.slope - a.slope + 2 * gamma)
    return step, (radicand >= 0) & jnp.isfinite(step)


def secant_minimizer(a: _Point, b: _Point) -> tuple[jax.Array, jax.Array]:
    """Where the line through the slopes at ``a`` and ``b`` crosses zero, and validity."""
    step = a.step - a.slope * (b.step - a.step) / (b.slope - a.slope)
    return step, jnp.isfinite(step) & (b.slope != a.slope)


def _zoom_trial(lo: _Point, hi: _Point, ulps: jax.Array) -> jax.Array:
    left, right = jnp.minimum(lo.step, hi.step), jnp.maximum(lo.step, hi.step)
    width = right - left
    # When the two values differ by rounding only, they carry no information: use the
    # slopes alone (a secant step), as Hager and Zhang do.
    flat = jnp.abs(hi.value - lo.value) <= ulps
    cubic, cubic_ok = cubic_minimizer(lo, hi)
    secant, secant_ok = secant_minimizer(lo, hi)
    guess, valid = jnp.where(flat, secant, cubic), jnp.where(flat, secant_ok, cubic_ok)
    # A model minimiser too close to an end is moved in to the safeguard, not replaced
    # by the midpoint: when the minimiser lies orders of magnitude inside the bracket
    # (a first step far too long), each trial still shrinks it tenfold, not twofold.
    guarded = jnp.clip(guess, left + MIN_SHRINK * width, right - MIN_SHRINK * width)
    usable = valid & jnp.isfinite(hi.value) & jnp.isfinite(hi.slope)
    return jnp.where(usable, guarded, 0.5 * (left + right))


def _extrapolate(previous: _Point, current: _Point, ulps: jax.Array) -> jax.Array:
    span = current.step - previous.step
    low, high = current.step + EXTRAPOLATE[0] * span, current.step + EXTRAPOLATE[1] * span
    flat = jnp.abs(current.value - previous.value) <= ulps
    cubic, cubic_ok = cubic_minimizer(previous, current)
    secant, secant_ok = secant_minimizer(previous, current)
    guess, valid = jnp.where(flat, secant, cubic), jnp.where(flat, secant_ok, cubic_ok)
    guess = jnp.where(valid & (guess > current.step), guess, high)
    return jnp.minimum(jnp.clip(guess, low, high), MAX_STEP)


def _along(params: Any, step: jax.Array, direction: Any) -> Any:
    """``params + step * direction``, each leaf in its own dtype."""
    return optax.tree.cast_like(optax.tree.add_scale(params, step, direction), params)


def _choose(flag: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(flag, n, o), new, old)


def zoom_linesearch(
    value_and_grad: ValueAndGrad,
    *,
    params: Any,
    value: jax.Array,
    grad: Any,
    direction: Any,
    initial_step: jax.Array,
    max_evaluations: int,
    c1: float,
    c2: float,
) -> LineSearchResult:
    """Finds a step along a descent ``direction`` satisfying the strong Wolfe conditions.

    Sufficient decrease ``f(x + a d) <= f(x) + c1 a f'(0)`` and curvature
    ``|f'(a)| <= c2 |f'(0)|``. When float precision can no longer resolve the
    decrease, a step meeting the curvature condition whose value rose by at most a few
    ulps is accepted too (Hager and Zhang's approximate Wolfe condition). Non-finite
    trials count as too long. If no trial meets the conditions within
    ``max_evaluations``, the best point with a sufficient decrease is returned, if
    any (``found`` is false only when there is none).
    """
    slope0 = jnp.asarray(optax.tree.vdot(grad, direction))
    origin = _Point(jnp.zeros_like(value), value, slope0)
    ulps = 8 * jnp.finfo(value.dtype).eps * jnp.abs(value)

    def cond(s: _Search) -> jax.Array:
        scale = jnp.maximum(s.hi.step, s.lo.step)
        collapsed = s.bracketed & (
            jnp.abs(s.hi.step - s.lo.step) <= 4 * jnp.finfo(value.dtype).eps * scale
        )
        return ~s.done & ~collapsed & (s.evaluations < max_evaluations)

    def body(s: _Search) -> _Search:
        trial_value, trial_grad = value_and_grad(_along(params, s.trial, direction))
        trial = _Point(s.trial, trial_value, jnp.asarray(optax.tree.vdot(trial_grad, direction)))
        finite = jnp.isfinite(trial.value) & jnp.isfinite(trial.slope)
        decrease = (trial.value <= value + c1 * trial.step * slope0) & (trial.value < s.lo.value)
        # Within a few ulps of the start, values can no longer rank points: judge the
        # trial by its slope alone (the approximate Wolfe condition).
        level = trial.value <= value + ulps
        too_long = ~finite | ~(decrease | level)
        curved = jnp.abs(trial.slope) <= -c2 * slope0
        accept = ~too_long & curved
        uphill = jnp.where(
            s.bracketed, trial.slope * (s.hi.step - s.lo.step) >= 0, trial.slope >= 0
        )
        new_lo = ~too_long | accept  # the trial becomes the best point
        flip = ~accept & ~too_long & uphill  # the old best point becomes the far end
        hi = _choose(too_long & ~accept, trial, _choose(flip, s.lo, s.hi))
        lo = _choose(new_lo, trial, s.lo)
        bracketed = s.bracketed | (too_long & ~accept) | flip
        next_trial = jnp.where(
            bracketed, _zoom_trial(lo, hi, ulps), _extrapolate(s.lo, trial, ulps)
        )
        return _Search(
            trial=next_trial,
            lo=lo,
            lo_grad=_choose(new_lo, trial_grad, s.lo_grad),
            hi=hi,
            bracketed=bracketed,
            done=accept,
            evaluations=s.evaluations + 1,
            any_finite=s.any_finite | finite,
        )

    start = _Search(
        trial=jnp.asarray(initial_step, value.dtype),
        lo=origin,
        lo_grad=grad,
        hi=origin,
        bracketed=jnp.asarray(False),
        done=jnp.asarray(False),
        evaluations=jnp.zeros((), jnp.int32),
        any_finite=jnp.asarray(False),
    )
    end = jax.lax.while_loop(cond, body, start)
    # Unaccepted, the best point counts only with a real decrease: one within a few
    # ulps of the start (a level point) may be uphill along a wrong gradient.
    found = (end.lo.step > 0) & (end.done | (end.lo.value < value))
    return LineSearchResult(
        step=end.lo.step,
        params=_choose(found, _along(params, end.lo.step, direction), params),
        value=end.lo.value,
        grad=end.lo_grad,
        evaluations=end.evaluations,
        found=found,
        nonfinite=~found & ~end.any_finite,
        # Still descending at the largest step, never bracketed: unbounded below.
        unbounded=found & ~end.bracketed & (end.lo.step >= MAX_STEP),
    )
