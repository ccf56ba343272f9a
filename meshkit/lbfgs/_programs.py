"""The jitted programs of one L-BFGS configuration, built once per (equal) settings."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshkit._host import replicated_sharding
from meshkit._pytree import Signature, abstract, signature
from meshkit._rules import PartitionRules, infer_shardings
from meshkit.lbfgs import _lbfgs
from meshkit.lbfgs._data import Dataset
from meshkit.lbfgs._lbfgs import LBFGSState, Options
from meshkit.lbfgs._objective import L2Mask, PerExampleLoss, gradient_blocks_for, make_objective
from meshkit.lbfgs._solution import solution_of


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the programs depend on; hashable, so equal solvers share programs."""

    loss_fn: PerExampleLoss
    mesh: Mesh
    data_axis: str
    l2_mask: L2Mask | None
    param_rules: PartitionRules | None
    gradient_blocks: int | None
    options: Options


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled entry points of one solver configuration."""

    init: Callable[..., LBFGSState]
    step: Callable[..., LBFGSState]
    run: Callable[..., LBFGSState]
    solution: Callable[..., Any]
    solve: Callable[..., Any]
    solve_many: Callable[..., Any]


def param_shardings(settings: Settings, params: Any) -> Any:
    """The sharding of each parameter leaf: ``param_rules``, or replicated."""
    return _param_shardings(settings, signature(params))


@functools.lru_cache(maxsize=64)
def _param_shardings(settings: Settings, params: Signature) -> Any:
    return infer_shardings(abstract(params), settings.mesh, settings.param_rules)


def state_shardings(settings: Settings, state: LBFGSState) -> Any:
    """An ``LBFGSState`` of shardings: parameter-shaped leaves follow the parameters."""
    params = param_shardings(settings, state.params)
    stacked = jax.tree.map(
        lambda sharding: NamedSharding(settings.mesh, PartitionSpec(None, *sharding.spec)), params
    )
    replicated = replicated_sharding(settings.mesh)
    shardings = jax.tree.map(lambda _: replicated, state)
    return shardings._replace(params=params, grad=params, s_history=stacked, y_history=stacked)


def _constrain(settings: Settings, state: LBFGSState) -> LBFGSState:
    return jax.lax.with_sharding_constraint(state, state_shardings(settings, state))


@functools.lru_cache(maxsize=32)
def programs(settings: Settings) -> Programs:
    """Jitted ``init``/``step``/``run``/``solve``/``solve_many`` for ``settings`` (cached)."""
    options = settings.options
    # Shardings at the boundary: the rows (and the mask) split over the data axis, the
    # strength and the step budget replicated. Parameters and states keep the shardings
    # they arrive with (the solver's ``place_params`` / ``load_state`` set them) and are
    # constrained to them inside, so the outputs come back the same way.
    rows = NamedSharding(settings.mesh, PartitionSpec(settings.data_axis))
    replicated = replicated_sharding(settings.mesh)

    devices = settings.mesh.shape[settings.data_axis]
    platform = settings.mesh.devices.flat[0].platform

    def objective(data: Dataset, l2: jax.Array, params: Any) -> _lbfgs.ValueAndGrad:
        per_device = gradient_blocks_for(
            platform=platform,
            rows_per_device=data.padded_rows // devices,
            param_count=sum(leaf.size for leaf in jax.tree.leaves(params)),
            limit=settings.gradient_blocks,
        )
        return make_objective(
            settings.loss_fn, data, l2, settings.l2_mask, gradient_blocks=devices * per_device
        )

    def stepper(data: Dataset, l2: jax.Array, params: Any) -> Callable[[LBFGSState], LBFGSState]:
        value_and_grad = objective(data, l2, params)
        return lambda state: _constrain(settings, _lbfgs.step(value_and_grad, state, options))

    def init(params: Any, data: Dataset, l2: jax.Array) -> LBFGSState:
        return _constrain(settings, _lbfgs.init(objective(data, l2, params), params, options))

    def step(state: LBFGSState, data: Dataset, l2: jax.Array) -> LBFGSState:
        return jax.lax.cond(state.status == 0, stepper(data, l2, state.params), lambda s: s, state)

    def run(state: LBFGSState, data: Dataset, l2: jax.Array, budget: jax.Array) -> LBFGSState:
        return _lbfgs.run(stepper(data, l2, state.params), state, state.iteration + budget)

    def solve(params: Any, data: Dataset, l2: jax.Array) -> Any:
        state = init(params, data, l2)
        return solution_of(_lbfgs.run(stepper(data, l2, params), state, options.max_steps))

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
