"""The jitted programs behind ``LBFGS``, built once per (equal) solver, and input checks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshkit._rules import infer_shardings
from meshkit.lbfgs import _lbfgs
from meshkit.lbfgs._data import Dataset
from meshkit.lbfgs._lbfgs import LBFGSState
from meshkit.lbfgs._objective import make_objective
from meshkit.lbfgs._solution import solution_of

if TYPE_CHECKING:
    from meshkit.lbfgs._solver import LBFGS


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled entry points of one solver configuration."""

    init: Callable[..., LBFGSState]
    step: Callable[..., LBFGSState]
    run: Callable[..., LBFGSState]
    solution: Callable[..., Any]
    solve: Callable[..., Any]
    solve_many: Callable[..., Any]


def param_shardings(solver: LBFGS, params: Any) -> Any:
    """The sharding of each parameter leaf: ``param_rules``, or replicated."""
    return infer_shardings(params, solver.mesh, solver.param_rules)


def state_shardings(solver: LBFGS, state: LBFGSState) -> Any:
    """An ``LBFGSState`` of shardings: parameter-shaped leaves follow the parameters."""
    params = param_shardings(solver, state.params)
    stacked = jax.tree.map(
        lambda sharding: NamedSharding(solver.mesh, PartitionSpec(None, *sharding.spec)), params
    )
    replicated = NamedSharding(solver.mesh, PartitionSpec())
    shardings = jax.tree.map(lambda _: replicated, state)
    return shardings._replace(params=params, grad=params, s_history=stacked, y_history=stacked)


def _constrain(solver: LBFGS, state: LBFGSState) -> LBFGSState:
    return jax.lax.with_sharding_constraint(state, state_shardings(solver, state))


@functools.lru_cache(maxsize=32)
def programs(solver: LBFGS) -> Programs:
    """Jitted ``init``/``step``/``run``/``solve``/``solve_many`` for ``solver`` (cached)."""
    options = solver.options
    # Shardings at the boundary: the rows (and the mask) split over the data axis, the
    # strength and the step budget replicated. Parameters and states keep the shardings
    # they arrive with (``LBFGS.place_params`` / ``load_state`` set them) and are
    # constrained to them inside, so the outputs come back the same way.
    rows = NamedSharding(solver.mesh, PartitionSpec(solver.data_axis))
    replicated = NamedSharding(solver.mesh, PartitionSpec())

    def objective(data: Dataset, l2: jax.Array) -> _lbfgs.ValueAndGrad:
        return make_objective(solver.loss_fn, data, l2, solver.l2_mask)

    def stepper(data: Dataset, l2: jax.Array) -> Callable[[LBFGSState], LBFGSState]:
        value_and_grad = objective(data, l2)
        return lambda state: _constrain(solver, _lbfgs.step(value_and_grad, state, options))

    def init(params: Any, data: Dataset, l2: jax.Array) -> LBFGSState:
        return _constrain(solver, _lbfgs.init(objective(data, l2), params, options))

    def step(state: LBFGSState, data: Dataset, l2: jax.Array) -> LBFGSState:
        return jax.lax.cond(state.status == 0, stepper(data, l2), lambda s: s, state)

    def run(state: LBFGSState, data: Dataset, l2: jax.Array, budget: jax.Array) -> LBFGSState:
        return _lbfgs.run(stepper(data, l2), state, state.iteration + budget)

    def solve(params: Any, data: Dataset, l2: jax.Array) -> Any:
        state = init(params, data, l2)
        return solution_of(_lbfgs.run(stepper(data, l2), state, options.max_steps))

    def solve_many(params: Any, data: Dataset, l2: jax.Array) -> Any:
        return jax.vmap(lambda strength: solve(params, data, strength))(l2)

    with_data = (None, rows, replicated)
    return Programs(
        init=jax.jit(init, in_shardings=with_data),
        step=jax.jit(step, in_shardings=with_data),
        run=jax.jit(run, in_shardings=(*with_data, replicated)),
        solution=jax.jit(solution_of),
        solve=jax.jit(solve, in_shardings=with_data),
        solve_many=jax.jit(solve_many, in_shardings=with_data),
    )


def check_params(params: Any) -> None:
    """Raises a clear error unless every leaf of ``params`` is a floating-point array."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("params is an empty pytree; pass the starting parameters.")
    for path, leaf in leaves:
        dtype = _dtype(leaf)
        if not np.issubdtype(dtype, np.floating):
            raise TypeError(
                f"Parameter {jax.tree_util.keystr(path) or '(root)'} has dtype {dtype}; L-BFGS "
                "needs floating-point parameters. Start from e.g. np.zeros(shape, np.float32)."
            )


def _dtype(leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)  # jax.Arrays: no device-to-host copy
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def _signature(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, *((np.shape(leaf), str(_dtype(leaf))) for leaf in leaves))


def _shapes(tree: Any) -> str:
    return str(jax.tree.map(lambda leaf: f"{_dtype(leaf)}{list(np.shape(leaf))}", tree))


_CHECKED: set[tuple[Any, ...]] = set()


def check_loss(solver: LBFGS, params: Any, data: Dataset) -> None:
    """Checks that ``loss_fn`` accepts ``params`` and the batch and returns one loss per row.

    Runs ``jax.eval_shape`` (no computation) once per solver and input signature.
    """
    key = (solver, _signature(params), _signature(data.batch), data.padded_rows)
    if key in _CHECKED:
        return
    abstract = functools.partial(jax.eval_shape, solver.loss_fn)
    try:
        losses = abstract(params, data.batch)
    except Exception as error:  # a user function failing on these shapes
        raise ValueError(
            f"loss_fn(params, batch) failed for params {_shapes(params)} and a batch "
            f"{_shapes(data.batch)}: {type(error).__name__}: {error}\nExpected parameters "
            "that fit the data (for multiclass_logreg: w of shape [num_features, "
            "num_classes] for x of shape [rows, num_features]). Check the shapes of the "
            "starting parameters and of the data."
        ) from error
    rows = data.padded_rows
    if not isinstance(losses, jax.ShapeDtypeStruct) or losses.shape != (rows,):
        got = getattr(losses, "shape", type(losses).__name__)
        raise ValueError(
            f"loss_fn must return one loss per example, shape ({rows},) for this batch "
            f"(its padded row count), got {got}. Return the per-example losses, not their "
            "mean: the solver masks the padded rows and divides by the real row count."
        )
    if not np.issubdtype(losses.dtype, np.floating):
        raise TypeError(f"loss_fn must return floating-point losses, got dtype {losses.dtype}.")
    if len(_CHECKED) > 4096:  # bounded: forget old signatures (they are only re-checked)
        _CHECKED.clear()
    _CHECKED.add(key)
