"""Why an L-BFGS solve stopped: a status enum with readable messages."""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Why the solver stopped; stored in the state as an ``int32`` code.

    ``GRADIENT_TOLERANCE`` and ``RELATIVE_DECREASE`` are successes; ``MAX_STEPS``,
    ``LINESEARCH_FAILED``, ``NONFINITE`` and ``UNBOUNDED`` are failures (``throw=True`` raises
    ``LBFGSError`` for them). ``RUNNING`` is the status of a state that can still step.

    Examples:
        >>> Status(1)
        <Status.GRADIENT_TOLERANCE: 1>
        >>> Status.MAX_STEPS.succeeded
        False
        >>> Status.GRADIENT_TOLERANCE.message
        'converged: the gradient norm is at most tol'
    """

    RUNNING = 0
    GRADIENT_TOLERANCE = 1
    RELATIVE_DECREASE = 2
    MAX_STEPS = 3
    LINESEARCH_FAILED = 4
    NONFINITE = 5
    UNBOUNDED = 6

    @property
    def message(self) -> str:
        """A sentence saying what happened and, for failures, what to do about it."""
        return _MESSAGES[self]

    @property
    def succeeded(self) -> bool:
        """Whether this status is a convergence criterion (not a failure, not running)."""
        return self in (Status.GRADIENT_TOLERANCE, Status.RELATIVE_DECREASE)

    @property
    def failed(self) -> bool:
        """Whether ``throw=True`` raises for this status."""
        return self in (
            Status.MAX_STEPS,
            Status.LINESEARCH_FAILED,
            Status.NONFINITE,
            Status.UNBOUNDED,
        )


_MESSAGES = {
    Status.RUNNING: "running: no stopping criterion has been met yet",
    Status.GRADIENT_TOLERANCE: "converged: the gradient norm is at most tol",
    Status.RELATIVE_DECREASE: (
        "converged: the objective decreased by at most rtol (relative) in one iteration"
    ),
    Status.MAX_STEPS: (
        "stopped: max_steps iterations ran before the gradient norm reached tol; raise "
        "max_steps, loosen tol, or continue from this state with LBFGS.run"
    ),
    Status.LINESEARCH_FAILED: (
        "failed: the line search found no step that decreases the objective enough within "
        "max_linesearch_steps trials. The gradient may not match the objective (a "
        "non-differentiable loss), or float32 precision is exhausted: loosen tol, set rtol, "
        "or solve in float64 (jax_enable_x64)"
    ),
    Status.NONFINITE: (
        "failed: the objective or its gradient is not finite (nan or inf) at the current "
        "parameters or everywhere the line search looked. Check the loss for log(0) or "
        "overflow and the data for nan/inf; padded rows are masked and cannot cause this"
    ),
    Status.UNBOUNDED: (
        "failed: the objective kept decreasing along the search direction up to the largest "
        "step tried (1e10), so it looks unbounded below; more steps will not help. Check "
        "the loss (a missing log or square, the wrong sign) or add an L2 term (l2 > 0)"
    ),
}
