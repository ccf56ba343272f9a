"""What a solve returns (parameters, how it stopped, the per-iteration history), and its error."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from meshkit._host import to_host
from meshkit.lbfgs._lbfgs import LBFGSState
from meshkit.lbfgs._status import Status


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Solution:
    """The result of ``LBFGS.solve`` (or of ``LBFGS.solution`` on a state).

    Every field is an array on the mesh (replicated), so building a ``Solution``
    never waits for the devices; ``status``, ``message`` and ``history`` read them.
    After ``LBFGS.solve_many``, every field has a leading axis, one entry per
    regularisation strength.

    Attributes:
      params: the last accepted iterate.
      value: the objective at ``params``.
      grad_norm: the Euclidean norm of the gradient at ``params``.
      iterations: the number of iterations (accepted steps).
      num_evaluations: evaluations of the value and gradient, line searches included.
      status_code: the ``Status`` as an ``int32`` array.
      value_history: the objective after each iteration (entry 0: at the start),
        ``[max_steps + 1]``, nan after the last iteration.
      grad_norm_history: the gradient norm after each iteration, likewise.
    """

    params: Any
    value: jax.Array
    grad_norm: jax.Array
    iterations: jax.Array
    num_evaluations: jax.Array
    status_code: jax.Array
    value_history: jax.Array
    grad_norm_history: jax.Array

    @property
    def statuses(self) -> list[Status]:
        """The status of every solve (one for ``solve``, one per strength for ``solve_many``)."""
        return [Status(int(code)) for code in np.ravel(to_host(self.status_code))]

    @property
    def status(self) -> Status:
        """Why the solve stopped; for ``solve_many`` results use ``statuses``."""
        if np.ndim(self.status_code) != 0:
            raise TypeError(
                f"This Solution holds {np.size(self.status_code)} solves (from solve_many); "
                "status is for a single solve. Use solution.statuses, one per strength."
            )
        return self.statuses[0]

    @property
    def message(self) -> str:
        """The status with its readable message, e.g. ``'GRADIENT_TOLERANCE: converged: ...'``."""
        return "; ".join(f"{status.name}: {status.message}" for status in self.statuses)

    @property
    def succeeded(self) -> bool:
        """Whether every solve met a convergence criterion."""
        return all(status.succeeded for status in self.statuses)

    def history(self) -> dict[str, np.ndarray]:
        """The value and gradient norm per iteration on the host, cut at the last iteration.

        Returns ``{"value": [iterations + 1], "grad_norm": [iterations + 1]}`` for a
        single solve; for ``solve_many`` results the arrays keep their full length
        (nan after each solve's last iteration).

        Examples:
            >>> import numpy as np, meshkit
            >>> from meshkit import lbfgs
            >>> mesh = meshkit.make_mesh("data=-1")
            >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
            >>> data = lbfgs.classification_data(x, (x[:, 0] > 0).astype(np.int32), mesh)
            >>> solver = lbfgs.LBFGS(lbfgs.multiclass_logreg, mesh, max_steps=50)
            >>> solution = solver.solve(lbfgs.linear_params(4, 2), data, l2=0.1)
            >>> history = solution.history()
            >>> len(history["grad_norm"]) == int(solution.iterations) + 1
            True
        """
        host = to_host(
            {"value": self.value_history, "grad_norm": self.grad_norm_history, "n": self.iterations}
        )
        if np.ndim(host["n"]) == 0:
            stop = int(host["n"]) + 1
            return {"value": host["value"][:stop], "grad_norm": host["grad_norm"][:stop]}
        return {"value": host["value"], "grad_norm": host["grad_norm"]}


class LBFGSError(RuntimeError):
    """A solve with ``throw=True`` ended with a failure status.

    Attributes:
      solution: the ``Solution`` the solve returned (its ``params`` are the last
        accepted iterate, so a warm start can continue from them).
    """

    def __init__(self, message: str, solution: Solution):
        super().__init__(message)
        self.solution = solution


def solution_of(state: LBFGSState) -> Solution:
    """The ``Solution`` view of a single (not batched) state; traceable."""
    return Solution(
        params=state.params,
        value=state.value,
        grad_norm=optax.tree.norm(state.grad),
        iterations=state.iteration,
        num_evaluations=state.num_evaluations,
        status_code=state.status,
        value_history=state.value_history,
        grad_norm_history=state.grad_norm_history,
    )


def raise_if_failed(solution: Solution, *, what: str = "L-BFGS") -> Solution:
    """Raises ``LBFGSError`` when any solve ended with a failure status; else returns it."""
    statuses = solution.statuses
    failed = [i for i, status in enumerate(statuses) if status.failed]
    if not failed:
        return solution
    host = to_host(
        {
            "value": solution.value,
            "grad_norm": solution.grad_norm,
            "iterations": solution.iterations,
            "evaluations": solution.num_evaluations,
        }
    )
    lines = []
    for i in failed:
        pick = {k: np.ravel(v)[i] for k, v in host.items()}
        where = f" (solve {i} of {len(statuses)})" if len(statuses) > 1 else ""
        lines.append(
            f"{what}{where} stopped with {statuses[i].name} after {pick['iterations']} "
            f"iterations and {pick['evaluations']} evaluations (value {pick['value']:.8g}, "
            f"gradient norm {pick['grad_norm']:.3g}): {statuses[i].message}."
        )
    lines.append("Pass throw=False to get the Solution back instead of this error.")
    raise LBFGSError("\n".join(lines), solution)
