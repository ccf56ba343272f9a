"""meshkit.sweep: members equal standalone runs; halving, PBT and resume are exact; errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from flax import nnx

import meshkit
from meshkit import checkpoint, data, ensemble, sweep, train
from meshkit.sweep import _run
from meshkit.sweep._schedules import halving_decision, pbt_decision
from meshkit.sweep._space import check_points

BATCH = 32
NUM_CLASSES = 10


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        x = nn.relu(nn.Dense(16)(x.reshape((x.shape[0], -1))))
        return nn.Dense(NUM_CLASSES)(x)


@functools.cache
def tiny_model() -> train.Model:
    """One model object for the module: the same programs, compiled once, for every test."""
    return train.linen_model(TinyMLP(), jnp.zeros((1, 8, 8, 1)))


@functools.cache
def adamw() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4)


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: jax.Array | float):
    targets = optax.smooth_labels(jax.nn.one_hot(labels, NUM_CLASSES), smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()


def swept_loss(params, state, batch, rng):
    """A member's loss with its own label smoothing, read from its state."""
    logits, collections = train.apply_model(state, batch["image"], params=params, rng=rng)
    smoothing = sweep.hyperparameter(state, "label_smoothing")
    loss = smoothed_cross_entropy(logits, batch["label"], smoothing)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss, ensemble.MemberOutput(collections, {"accuracy": accuracy}, logits)


def layout_for(num_members: int) -> ensemble.EnsembleLayout:
    """Members over ``ensemble`` (two per device where they fit) and the rest on ``data``."""
    devices = jax.device_count()
    size = math.gcd(max(num_members // 2, 1), devices)
    return ensemble.EnsembleLayout(
        meshkit.make_mesh(f"ensemble={size},data={devices // size}"), num_members
    )


def eval_pipeline(layout: ensemble.EnsembleLayout) -> data.EvalPipeline:
    return data.EvalPipeline(
        data.digits("test"), global_batch_size=64, sharding=layout.batch_sharding
    )


POINTS = (
    {"learning_rate": 0.01, "label_smoothing": 0.0, "init_seed": 3, "data_seed": 5},
    {"learning_rate": 0.03, "label_smoothing": 0.1, "init_seed": 4, "data_seed": 6},
    {"learning_rate": 0.01, "label_smoothing": 0.2, "init_seed": 3, "data_seed": 7},
    {"learning_rate": 0.003, "label_smoothing": 0.1, "init_seed": 8, "data_seed": 5},
)
STEPS = 5


def run_points(
    workdir: Path, strategy: str = "auto", model: train.Model | None = None, **kwargs
) -> sweep.SweepResult:
    layout = layout_for(len(POINTS))
    run = {key: kwargs.pop(key) for key in ("checkpoints", "dispatch") if key in kwargs}
    experiment = sweep.Sweep(
        model or tiny_model(),
        adamw(),
        swept_loss,
        layout,
        POINTS,
        loss_values=("label_smoothing",),
        strategy=strategy,  # pyright: ignore[reportArgumentType]
        **kwargs,
    )
    return sweep.run_sweep(
        experiment,
        pipeline=sweep.sweep_pipeline(
            data.digits("train"), POINTS, layout, global_batch_size=BATCH
        ),
        evaluation=train.Evaluation(eval_pipeline(layout)),
        num_steps=STEPS,
        workdir=workdir,
        logging=train.Logging(every=1, progress=False),
        **run,
    )


def standalone(
    point: dict,
    workdir: Path,
    model: train.Model | None = None,
    precision: str | None = None,
    microbatches: int = 1,
) -> tuple[list[float], object]:
    """Member ``point`` as an ordinary data-parallel run: plain AdamW, a constant smoothing."""
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    smoothing = point["label_smoothing"]

    def loss_fn(params, state, batch, rng):
        logits, collections = train.apply_model(state, batch["image"], params=params, rng=rng)
        return smoothed_cross_entropy(logits, batch["label"], smoothing), train.LossOutput(
            collections, {}
        )

    tx = optax.adamw(point["learning_rate"], weight_decay=1e-4)
    state = train.create_train_state(
        model or tiny_model(), tx, mesh, seed=point["init_seed"], precision=precision
    )
    step = train.make_train_step(
        loss_fn, train.state_shardings_of(state), sharding, microbatches=microbatches
    )
    pipeline = data.TrainPipeline(
        data.digits("train"), global_batch_size=BATCH, sharding=sharding, seed=point["data_seed"]
    )
    result = train.fit(
        state,
        step,
        pipeline,
        num_steps=STEPS,
        workdir=workdir,
        logging=train.Logging(every=1, progress=False),
    )
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], meshkit.to_host(result.state.params)


@pytest.fixture(scope="module")
def standalone_runs(tmp_path_factory) -> list[tuple[list[float], object]]:
    """Each point as its own ordinary run: the reference for both member strategies."""
    folder = tmp_path_factory.mktemp("standalone")
    return [standalone(point, folder / str(index)) for index, point in enumerate(POINTS)]


@pytest.mark.once(8)
@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_each_member_follows_its_standalone_run(strategy: str, standalone_runs, tmp_path: Path):
    result = run_points(tmp_path / "sweep", strategy)
    assert result.train_step_compiles == 1 and result.step == STEPS
    records = [
        json.loads(line)
        for line in (tmp_path / "sweep" / "stage_0" / "metrics.jsonl").read_text().splitlines()
    ]
    params = meshkit.to_host(result.state.params)
    for index, (losses, reference) in enumerate(standalone_runs):
        member_losses = [r[f"member_{index}/loss"] for r in records if "loss" in r]
        np.testing.assert_allclose(member_losses, losses, rtol=2e-5)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(got[index], want, rtol=2e-5, atol=2e-6)
    assert [t.point for t in result.trials] == [dict(p) for p in POINTS]
    assert sorted(t.id for t in result.ranked()) == [0, 1, 2, 3]


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 16, rngs=rngs)
        self.out = nnx.Linear(16, NUM_CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x.reshape((x.shape[0], -1)))))


@pytest.mark.once
def test_an_nnx_member_in_float16_with_microbatches_follows_its_standalone_run(tmp_path: Path):
    model = train.nnx_model(NnxMLP)
    settings = {"precision": "f16", "microbatches": 2}
    result = run_points(tmp_path / "sweep", model=model, **settings)
    assert result.train_step_compiles == 1
    records = [
        json.loads(line)
        for line in (tmp_path / "sweep" / "stage_0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("member_0/loss_scale" in r for r in records if "loss" in r)
    params = meshkit.to_host(result.state.params)
    for index in (0, 1):
        losses, reference = standalone(
            POINTS[index], tmp_path / f"alone_{index}", model=model, **settings
        )
        member_losses = [r[f"member_{index}/loss"] for r in records if "loss" in r]
        np.testing.assert_allclose(member_losses, losses, rtol=2e-3)  # float16 compute
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(got[index], want, rtol=2e-3, atol=2e-4)


def grid_run(points, workdir: Path, model=None, tx=None) -> sweep.SweepResult:
    layout = layout_for(len(points))
    experiment = sweep.Sweep(
        model or tiny_model(), tx or adamw(), ensemble.classification_loss, layout, points
    )
    return sweep.run_sweep(
        experiment,
        pipeline=sweep.sweep_pipeline(
            data.digits("train"), points, layout, global_batch_size=BATCH
        ),
        evaluation=train.Evaluation(eval_pipeline(layout)),
        num_steps=2,
        workdir=workdir,
        logging=train.Logging(every=1, progress=False),
    )


@pytest.mark.devices(8)
def test_a_sixteen_point_sweep_compiles_once_and_new_values_compile_nothing(tmp_path: Path):
    space = sweep.Space(
        learning_rate=sweep.log_grid(1e-3, 1e-1, 4), weight_decay=sweep.log_grid(1e-5, 1e-2, 4)
    )
    model, tx = tiny_model(), adamw()
    first = grid_run(space.grid(), tmp_path / "first", model, tx)
    assert first.train_step_compiles == 1
    # Other values of the same names: the values are arrays, so nothing recompiles.
    other = sweep.Space(learning_rate=sweep.LogUniform(1e-4, 1e-1), weight_decay=[0.0, 1e-3])
    with meshkit.count_compiles() as compiles:
        second = grid_run(other.sample(16, seed=1), tmp_path / "second", model, tx)
    assert second.train_step_compiles == 0 and compiles.count() == 0, compiles
    learning_rates = meshkit.to_host(sweep.hyperparameter(second.state, "learning_rate"))
    np.testing.assert_allclose(
        learning_rates, [p["learning_rate"] for p in other.sample(16, seed=1)], rtol=1e-6
    )


def trained_state(layout: ensemble.EnsembleLayout, points) -> train.TrainState:
    """Members after two steps of AdamW, so the optimizer state is not its initial value."""
    state = sweep.create_sweep_state(
        tiny_model(), adamw(), layout, points, loss_values=("label_smoothing",)
    )
    step = _run._step(swept_loss, layout, True, 1, "auto")  # run_sweep's own (cached) step
    pipeline = sweep.sweep_pipeline(data.digits("train"), points, layout, global_batch_size=BATCH)
    with data.GlobalBatchIterator(pipeline) as batches:
        for _ in range(2):
            state, _ = step(state, next(batches))
    return state


def moves_for(decision, points) -> dict:
    return {
        "source": np.asarray(decision.source, np.int32),
        "refresh": decision.refresh,
        "active": decision.active,
        "seeds": np.asarray([p["init_seed"] for p in decision.points], np.uint32),
        "values": {
            name: np.asarray([p[name] for p in decision.points], np.float32)
            for name in ("learning_rate", "label_smoothing")
        },
    }


@pytest.mark.once(8)  # the members move between devices
def test_a_pbt_exploit_copies_its_source_exactly():
    layout = layout_for(len(POINTS))
    before = meshkit.to_host(trained_state(layout, POINTS))
    scores = np.array([0.9, 0.5, 0.2, 0.8])  # slot 2 is the worst, slot 0 the best
    decision = pbt_decision(
        sweep.PopulationBasedTraining(every=2),
        step=2,
        scores=scores,
        points=check_points(POINTS),
        mode="max",
        space=None,
        seed=0,
    )
    assert decision.changed == (2,) and decision.source.tolist() == [0, 1, 0, 3]
    new_point = decision.points[2]
    assert new_point["learning_rate"] / POINTS[0]["learning_rate"] in (0.8, 1.25)
    assert new_point["init_seed"] == POINTS[2]["init_seed"]  # seeds stay with the slot
    state = trained_state(layout, POINTS)
    after = meshkit.to_host(
        _run._reassign(tiny_model(), layout)(state, moves_for(decision, POINTS))
    )
    for got, was in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params), strict=True):
        np.testing.assert_array_equal(got[2], was[0])  # the copy, bit for bit
        np.testing.assert_array_equal(got[[0, 1, 3]], was[[0, 1, 3]])  # the rest untouched
    inner_after, inner_before = after.opt_state.inner, before.opt_state.inner
    for got, was in zip(
        jax.tree.leaves(inner_after.inner_state),
        jax.tree.leaves(inner_before.inner_state),
        strict=True,
    ):
        np.testing.assert_array_equal(got[2], was[0])
    np.testing.assert_array_equal(after.step, before.step[[0, 1, 0, 3]])
    np.testing.assert_array_equal(after.rng, before.rng)  # each keeps its own dropout key
    learning_rates = inner_after.hyperparams["learning_rate"]
    assert learning_rates[2] == np.float32(new_point["learning_rate"])
    assert after.opt_state.values["label_smoothing"][2] == np.float32(new_point["label_smoothing"])


@pytest.mark.once(8)  # the members move between devices
def test_halving_freezes_the_worst_and_never_touches_the_survivors():
    layout = layout_for(len(POINTS))
    points = check_points(POINTS)
    decision = halving_decision(
        sweep.SuccessiveHalving(rungs=(2,), fraction=0.5),
        step=2,
        scores=np.array([0.3, 0.9, 0.1, 0.7]),
        active=np.ones(4, bool),
        points=points,
        mode="max",
        space=None,
        seed=0,
    )
    assert decision.active.tolist() == [False, True, False, True]
    state = trained_state(layout, POINTS)
    reference = trained_state(layout, POINTS)  # the same members, left alone
    state = _run._reassign(tiny_model(), layout)(state, moves_for(decision, points))
    step = _run._step(swept_loss, layout, True, 1, "auto")
    pipeline = sweep.sweep_pipeline(data.digits("train"), POINTS, layout, global_batch_size=BATCH)
    frozen = meshkit.to_host(state.params)
    with data.GlobalBatchIterator(pipeline) as batches:
        for _ in range(2):
            batch = next(batches)
            state, _ = step(state, batch)
            reference, _ = step(reference, batch)
    got, want = meshkit.to_host(state.params), meshkit.to_host(reference.params)
    for leaf, reference_leaf, frozen_leaf in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(frozen), strict=True
    ):
        np.testing.assert_array_equal(leaf[[1, 3]], reference_leaf[[1, 3]])  # survivors
        np.testing.assert_array_equal(leaf[[0, 2]], frozen_leaf[[0, 2]])  # stopped: frozen

    refill = halving_decision(
        sweep.SuccessiveHalving(rungs=(2,), refill=True),
        step=2,
        scores=np.array([0.3, 0.9, 0.1, 0.7]),
        active=np.ones(4, bool),
        points=points,
        mode="max",
        space=sweep.Space(
            learning_rate=[0.1, 0.2], label_smoothing=[0.0], init_seed=[11, 12], data_seed=[0]
        ),
        seed=0,
    )
    assert (
        refill.changed == (0, 2)
        and refill.active.all()
        and refill.refresh.tolist()
        == [
            True,
            False,
            True,
            False,
        ]
    )
    assert [refill.points[s]["data_seed"] for s in (0, 2)] == [5, 7]  # the slot's data order
    state = _run._reassign(tiny_model(), layout)(
        trained_state(layout, POINTS), moves_for(refill, points)
    )
    fresh = train.create_train_state(
        tiny_model(), adamw(), meshkit.make_mesh("data=-1"), seed=int(refill.points[0]["init_seed"])
    )
    for leaf, fresh_leaf in zip(
        jax.tree.leaves(meshkit.to_host(state.params)),
        jax.tree.leaves(meshkit.to_host(fresh.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(leaf[0], fresh_leaf)
    assert meshkit.to_host(state.step).tolist() == [0, 2, 0, 2]


@pytest.mark.once
def test_a_killed_pbt_sweep_resumes_to_the_same_table(tmp_path: Path, monkeypatch):
    pbt = sweep.PopulationBasedTraining(every=2, quantile=0.25)
    space = sweep.Space(learning_rate=sweep.LogUniform(1e-3, 1e-1), label_smoothing=[0.0, 0.1, 0.2])
    settings = {"schedule": pbt, "space": space, "checkpoints": train.Checkpoints(every=1)}
    whole = run_points(tmp_path / "whole", **settings)

    calls = {"count": 0}
    real_full_eval = _run.full_eval

    def dies_at_the_second_boundary(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 2:
            raise KeyboardInterrupt("killed")
        return real_full_eval(*args, **kwargs)

    monkeypatch.setattr(_run, "full_eval", dies_at_the_second_boundary)
    with pytest.raises(KeyboardInterrupt):
        run_points(tmp_path / "killed", **settings)
    monkeypatch.setattr(_run, "full_eval", real_full_eval)
    resumed = run_points(tmp_path / "killed", **settings)

    def table(result: sweep.SweepResult) -> dict:
        return {k: v for k, v in result.to_json().items() if k != "train_step_compiles"}

    assert table(resumed) == table(whole)  # trials, scores, lineage: all equal
    assert len(whole.trials) > len(POINTS)  # exploits happened
    assert any(t.parent is not None for t in whole.trials)
    for got, want in zip(
        jax.tree.leaves(meshkit.to_host(resumed.state)),
        jax.tree.leaves(meshkit.to_host(whole.state)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    best = whole.best
    assert best.status == "finished"
    saved = whole.save_best(tmp_path / "best")
    hyper = json.loads((saved / "hyperparameters.json").read_text())
    assert hyper["hyperparameters"] == best.point and hyper["trial"] == best.id
    target = whole.best_state()
    restored, data_state = checkpoint.Checkpointer(saved, save_every=1).restore(target)
    assert data_state == {"step": STEPS}
    for got, want in zip(
        jax.tree.leaves(meshkit.to_host(restored.params)),
        jax.tree.leaves(meshkit.to_host(whole.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want[best.slot])
    import matplotlib
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # the caller's backend (a notebook's, say) is left as it is
    try:
        curves = whole.plot(tmp_path / "sweep.png")
        assert matplotlib.get_backend() == "svg"
        last_only = [dataclasses.replace(t, history=t.history[-1:]) for t in whole.trials]
        ranks = dataclasses.replace(whole, trials=last_only).plot(tmp_path / "ranks.png")
    finally:
        matplotlib.use(before)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    evaluated = [t for t in whole.trials if t.history]
    assert len(curves.axes[1].lines) == len(evaluated)  # several evaluations: a curve each
    bars = [bar for bar in ranks.axes[1].patches if isinstance(bar, Rectangle)]  # a bar each
    assert [bar.get_width() for bar in bars] == [
        t.history[-1][1] for t in whole.ranked() if t.history
    ]
    red = [to_hex(bar.get_facecolor()) == to_hex("tab:red") for bar in bars]
    assert red == [t.id == best.id for t in whole.ranked() if t.history] and red[0]


@pytest.mark.once
def test_space_grid_sample_and_log_grid():
    space = sweep.Space(learning_rate=[0.1, 0.01], weight_decay=[0.0, 1e-4, 1e-3])
    grid = space.grid()
    assert len(grid) == 6 and grid[1] == {"learning_rate": 0.1, "weight_decay": 1e-4}
    drawn = sweep.Space(learning_rate=sweep.LogUniform(1e-4, 1e-1), b1=sweep.Uniform(0.8, 0.99))
    assert drawn.sample(5, seed=3) == drawn.sample(5, seed=3) != drawn.sample(5, seed=4)
    values = np.log10([p["learning_rate"] for p in drawn.sample(400, seed=0)])
    assert values.min() >= -4 and values.max() <= -1
    # log10 of the draws is uniform on [-4, -1] (scipy's Kolmogorov-Smirnov test)
    assert scipy.stats.kstest(values, scipy.stats.uniform(-4, 3).cdf).pvalue > 0.01
    assert sweep.log_grid(1e-5, 1e-2, 4) == (1e-5, 1e-4, 1e-3, 1e-2)


@pytest.mark.once
@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (sweep.Space, ValueError, "The space is empty"),
        (lambda: sweep.Space(learning_rate=[]), ValueError, "'learning_rate' has no values"),
        (lambda: sweep.Space(learning_rate=[float("nan")]), ValueError, "expected a finite"),
        (lambda: sweep.Space(learning_rate=[[0.1]]), TypeError, "expected a real scalar"),  # pyright: ignore[reportArgumentType]
        (lambda: sweep.Space(learning_rate=0.1), TypeError, "expected a list of values"),  # pyright: ignore[reportArgumentType]
        (lambda: sweep.LogUniform(0.0, 1.0), ValueError, "0 < low < high"),
        (lambda: sweep.Space(init_seed=[1.5]), ValueError, "non-negative ints"),
        (lambda: sweep.Space(lr=sweep.LogUniform(1e-3, 1.0)).grid(), ValueError, "log_grid"),
        (lambda: check_points([]), ValueError, "The sweep has no points"),
        (lambda: check_points([{"a": 1.0}, {"b": 1.0}]), ValueError, "the same hyperparameters"),
    ],
)
def test_bad_spaces_are_explained(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.once
@pytest.mark.devices(8)  # some of its cases need several devices
def test_bad_sweeps_are_explained(tmp_path: Path):
    layout = layout_for(2)
    model = tiny_model()
    with pytest.raises(ValueError, match=r"\['learnig_rate'\].*'learning_rate'.*loss_values="):
        sweep.create_sweep_state(model, adamw(), layout, [{"learnig_rate": 0.1}] * 2)
    with pytest.raises(ValueError, match=r"Wrap the optimizer in optax\.inject_hyperparams"):
        sweep.create_sweep_state(model, optax.sgd(0.1), layout, [{"learning_rate": 0.1}] * 2)
    with pytest.raises(ValueError, match=r"3 points but the layout holds 2 members \(Ensemble"):
        sweep.create_sweep_state(model, adamw(), layout, [{"learning_rate": 0.1}] * 3)
    with pytest.raises(ValueError, match=r"num_members=12 cannot be split evenly\b"):
        ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=8"), 12)
    two = [{"learning_rate": 0.1}, {"learning_rate": 0.2}]
    loss = ensemble.classification_loss
    with pytest.raises(ValueError, match=r"3 points but the layout holds 2 members"):
        sweep.Sweep(model, adamw(), loss, layout, [*two, {"learning_rate": 0.3}])
    with pytest.raises(ValueError, match=r"refill=True\) fills stopped slots.*Sweep\(space="):
        sweep.Sweep(
            model, adamw(), loss, layout, two, schedule=sweep.SuccessiveHalving((1,), refill=True)
        )
    with pytest.raises(ValueError, match=r"mode=\.\.\.\) must be 'max'.*got 'best'"):
        sweep.Sweep(model, adamw(), loss, layout, two, mode="best")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"evaluation=\.\.\.\) must be a meshkit.train.Evaluation"):
        sweep.run_sweep(
            sweep.Sweep(model, adamw(), loss, layout, two),
            pipeline=sweep.sweep_pipeline(
                data.digits("train"), two, layout, global_batch_size=BATCH
            ),
            evaluation=eval_pipeline(layout),  # pyright: ignore[reportArgumentType]
            num_steps=1,
            workdir=tmp_path / "typed",
        )
    points = [{"learning_rate": 0.1, "data_seed": 1}, {"learning_rate": 0.2, "data_seed": 2}]
    shared = data.TrainPipeline(
        data.digits("train"), global_batch_size=BATCH, sharding=layout.batch_sharding
    )
    with pytest.raises(ValueError, match=r"set data_seed \[1, 2\].*sweep_pipeline"):
        sweep.run_sweep(
            sweep.Sweep(model, adamw(), ensemble.classification_loss, layout, points),
            pipeline=shared,
            evaluation=train.Evaluation(eval_pipeline(layout)),
            num_steps=1,
            workdir=tmp_path,
        )
    grid_run([{"learning_rate": 0.1}, {"learning_rate": 0.2}], tmp_path / "run")
    with pytest.raises(ValueError, match=r"holds a sweep with other \['points'\].*new workdir"):
        grid_run([{"learning_rate": 0.1}, {"learning_rate": 0.3}], tmp_path / "run")


POISONED_FROM = 15  # a member whose ``poison`` is 1 gives a NaN loss from its 16th step on


def poisoned_loss(params, state, batch, rng):
    """Cross-entropy, NaN from step ``POISONED_FROM + 1`` for a member whose ``poison`` is 1
    (its gradients stay finite: the member must be frozen for its loss alone)."""
    logits, collections = train.apply_model(state, batch["image"], params=params, rng=rng)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    poisoned = (sweep.hyperparameter(state, "poison") > 0) & (state.step >= POISONED_FROM)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss + jnp.where(poisoned, jnp.nan, 0.0), ensemble.MemberOutput(
        collections, {"accuracy": accuracy}, logits
    )


def poison_run(
    poison: list[float], workdir: Path, num_steps: int = 20, **kwargs
) -> sweep.SweepResult:
    points = [
        {"learning_rate": 0.01, "poison": value, "init_seed": seed}
        for value, seed in zip(poison, (3, 4), strict=True)
    ]
    layout = layout_for(len(points))
    experiment = sweep.Sweep(
        tiny_model(), adamw(), poisoned_loss, layout, points, loss_values=("poison",), **kwargs
    )
    return sweep.run_sweep(
        experiment,
        pipeline=sweep.sweep_pipeline(
            data.digits("train"), points, layout, global_batch_size=BATCH
        ),
        evaluation=train.Evaluation(eval_pipeline(layout)),
        num_steps=num_steps,
        workdir=workdir,
        logging=train.Logging(every=1, progress=False),
    )


@pytest.mark.once
def test_a_member_that_diverges_is_frozen_and_the_sweep_goes_on(tmp_path: Path, capsys):
    poisoned = poison_run([0.0, 1.0], tmp_path / "poisoned")
    healthy, trial = poisoned.trials
    assert (healthy.status, trial.status, trial.end) == ("finished", "diverged", 16)
    assert "step 16: slot 1 (trial 1) diverged" in capsys.readouterr().out
    assert "diverged at 16" in poisoned.table()
    saved = json.loads((tmp_path / "poisoned" / "results.json").read_text())
    assert [(t["trial"], t["status"], t["end"]) for t in saved["trials"]] == [
        (0, "finished", 20),
        (1, "diverged", 16),
    ]
    assert poisoned.best.id == 0
    records = [
        json.loads(line)
        for line in (tmp_path / "poisoned" / "stage_0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["diverged"] for r in records if "diverged" in r] == [0.0] * 15 + [1.0] * 5
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)

    # The healthy member trained exactly as without the other's NaNs; the diverged one
    # kept the parameters of its last finite step.
    clean = poison_run([0.0, 0.0], tmp_path / "clean")
    before = poison_run([0.0, 0.0], tmp_path / "before", num_steps=POISONED_FROM)
    assert clean.trials[0].score() == healthy.score()
    got = meshkit.to_host(poisoned.state.params)
    for leaf, clean_leaf, before_leaf in zip(
        jax.tree.leaves(got),
        jax.tree.leaves(meshkit.to_host(clean.state.params)),
        jax.tree.leaves(meshkit.to_host(before.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(leaf[0], clean_leaf[0])
        np.testing.assert_array_equal(leaf[1], before_leaf[1])

    # Population-based training gives the diverged slot a copy of a better member.
    pbt = poison_run(
        [0.0, 1.0],
        tmp_path / "pbt",
        schedule=sweep.PopulationBasedTraining(every=POISONED_FROM + 1, quantile=0.5),
    )
    assert [(t.id, t.status, t.end, t.parent) for t in pbt.trials] == [
        (0, "finished", 20, None),
        (1, "diverged", 16, None),
        (2, "finished", 20, 0),
    ]

    with pytest.raises(train.NonFiniteLossError, match=r"Every member of the sweep diverged \("
                       r"trials \[0, 1\], in stage_0\)\. Training stopped at step 16"):  # fmt: skip
        poison_run([1.0, 1.0], tmp_path / "all")


@pytest.mark.once
def test_a_member_whose_loss_never_fell_did_not_learn_and_is_never_best():
    def ended(trial_id: int, initial: float, loss: float, accuracy: float) -> sweep.Trial:
        trial = sweep.Trial(trial_id, trial_id, {"learning_rate": 10.0**-trial_id}, None, 0)
        trial.initial_loss = initial
        trial.record(20, accuracy, {"loss": loss, "accuracy": accuracy})
        trial.finish(20)
        return trial

    # At chance after a rate too high (the loss flat at ln 10, above its start), then a
    # member that learned, then one whose loss fell by less than 1%.
    trials = [
        ended(0, 2.301, 2.3026, 0.0889),
        ended(1, 2.301, 0.35, 0.95),
        ended(2, 2.3, 2.29, 0.1),
    ]
    assert [t.status for t in trials] == ["did not learn", "finished", "did not learn"]
    result = sweep.SweepResult(
        trials=trials, slots=[0, 1, 2], state=None,  # pyright: ignore[reportArgumentType]
        metric="accuracy", mode="max", step=20,
        workdir=".", train_step_compiles=1,
    )  # fmt: skip
    assert result.best.id == 1 and [t.id for t in result.ranked()] == [1, 2, 0]
    assert "did not learn" in result.table().splitlines()[2]
    result.trials = [trials[0], trials[2]]
    with pytest.raises(ValueError, match=r"No trial of the sweep learned: .*Try smaller"):
        _ = result.best


@pytest.mark.once
def test_pbt_replaces_a_diverged_member_and_halving_skips_it():
    """A diverged trial's last finite score is history: decisions rank it last."""
    trials = [sweep.Trial(k, k, {"learning_rate": 0.1}, None, 0) for k in range(4)]
    for trial, score in zip(trials, [0.9, 0.5, 0.2, 0.8], strict=True):
        trial.record(10, score, {})
    trials[0].diverge(12)  # the best so far, then NaN
    scores = np.array([math.nan if t.diverged else t.score() for t in trials])
    points = check_points([t.point for t in trials])
    pbt = pbt_decision(
        sweep.PopulationBasedTraining(every=10),
        step=20,
        scores=scores,
        points=points,
        mode="max",
        space=None,
        seed=0,
    )
    assert pbt.changed == (0,) and int(pbt.source[0]) != 0  # the diverged slot copies a donor
    halving = halving_decision(
        sweep.SuccessiveHalving(rungs=(20,)),
        step=20,
        scores=scores,
        active=np.array([False, True, True, True]),
        points=points,
        mode="max",
        space=None,
        seed=0,
    )
    assert halving.active.tolist() == [False, True, False, True]
