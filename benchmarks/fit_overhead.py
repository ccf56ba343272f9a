"""What ``fit`` costs per step beyond the step itself, against two hand-written loops.

    python -m benchmarks fit_overhead        # any backend; on CPU, 1 and 8 fake devices

The same jitted train step (``make_train_step``), the same state and the same data,
three ways, interleaved A B C A B C with a fresh state every round:

- bare step: a hand loop over batches already on the devices (16 placed batches,
  cycled): the step rate with no input work at all;
- gather + device_put: a hand loop that takes each batch's rows from the in-memory
  arrays (the pipeline's own ``local_batch``) and ``jax.device_put``s them, as a user
  would write without meshkit;
- fit: ``meshkit.train.fit`` over the ``TrainPipeline`` of the same arrays, logging
  every 10 steps, one checkpoint (the last step), no evaluation: host input, one step
  per dispatch (the default; ``python -m benchmarks host_placement`` compares who
  places the batches);
- fit resident: the same with ``resident=True`` (the dataset on the devices, batches
  gathered there by index), one step per dispatch, then N = 8, 32 and ``'auto'`` steps
  per dispatch (``Dispatch(steps_per_dispatch=N)``); ``'auto'`` measures afresh every
  round, as a new process's first run does, and ``N=auto, measured before`` chooses
  from the measurement of an earlier round, as a later ``fit`` of the same step in the
  process does.

Ratios are to the bare step loop (rates, from totals).

Every candidate is timed from the end of its first step (which holds the compile) to
the end of its last, so the three rates are steady-state rates measured the same way
(``fit`` reports its own, checkpoint and evaluation time excluded). On several CPU
devices the hand loops wait for step k-1 after queuing step k, as ``fit`` does there
(queuing many multi-device steps on fake CPU devices can stall XLA's rendezvous); on a
GPU or TPU they never wait.

Models: a tiny MLP on the 8×8 digits (batch 64: the bookkeeping dominates), and the
MNIST CNN of the Flax ensembling HOWTO on the digits resized to 28×28 (batch 128); and
an ensemble of 8 tiny MLPs on the ``ensemble`` axis (``--models ensemble``).
"""

from __future__ import annotations

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

import collections  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any, Literal  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks._harness import Measured, fit_once, interleave, report, save  # noqa: E402
from meshkit import data, train  # noqa: E402
from meshkit.models import MnistCNN  # noqa: E402

ON_CPU = jax.devices()[0].platform == "cpu"
ROUNDS = 5
FIT_CHUNKS: tuple[int | Literal["auto"], ...] = (8, 32, "auto")
"""Steps per dispatch of the resident ``fit`` candidates (N=1 is "fit resident")."""


class TinyMLP(nn.Module):
    """64 inputs, 32 hidden units, 10 classes: a step of a few microseconds of math."""

    @nn.compact
    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        x = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def hand_loop(
    step: Callable[..., Any], state: Any, next_batch: Callable[[int], Any], n: int, *, wait: bool
) -> Measured:
    """Runs ``n`` steps; returns the seconds of steps 2..n. ``wait``: block on step k-1."""
    state, metrics = step(state, next_batch(0))
    jax.block_until_ready(metrics)
    queued: collections.deque[Any] = collections.deque()
    started = time.perf_counter()
    for k in range(1, n):
        state, metrics = step(state, next_batch(k))
        if wait:
            queued.append(metrics)
            if len(queued) > 1:
                jax.block_until_ready(queued.popleft())
    jax.block_until_ready(state)
    return Measured(time.perf_counter() - started)


def digits_classifier(
    module: nn.Module, *, image_size: Literal[8, 28], mesh
) -> tuple[data.ArraySource, Callable[[], Any], Callable[..., Any]]:
    """The digits at ``image_size``, a fresh-state maker (SGD with momentum, seed 0) and
    the jitted train step of ``module`` on ``mesh``: what every candidate shares."""
    source = data.digits("train", image_size=image_size)
    model = train.linen_model(module, jnp.zeros((1, image_size, image_size, 1)))
    tx = optax.sgd(0.05, momentum=0.9)

    def fresh_state():
        return train.create_train_state(model, tx, mesh, seed=0)

    step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(fresh_state()),
        meshkit.batch_sharding(mesh),
    )
    return source, fresh_state, step


def case(
    name: str, module: nn.Module, *, image_size: Literal[8, 28], batch: int, mesh, steps: int
) -> dict:
    sharding = meshkit.batch_sharding(mesh)
    source, fresh_state, step = digits_classifier(module, image_size=image_size, mesh=mesh)
    pipeline = data.TrainPipeline(source, global_batch_size=batch, sharding=sharding, seed=0)
    placed = [jax.device_put(pipeline.local_batch(k), sharding) for k in range(16)]
    wait = ON_CPU and mesh.size > 1
    fit_stats: dict[str, list[float]] = {"input_wait_fraction": [], "compiles": []}

    def bare():
        return hand_loop(step, fresh_state(), lambda k: placed[k % 16], steps, wait=wait)

    def gather_and_put():
        def next_batch(k):
            return jax.device_put(pipeline.local_batch(k), sharding)

        return hand_loop(step, fresh_state(), next_batch, steps, wait=wait)

    resident = data.TrainPipeline(
        source,
        global_batch_size=batch,
        sharding=sharding,
        seed=0,
        input_settings=data.InputSettings(resident=True),
    )
    auto_chose: list[str] = []

    def fit(
        on: data.TrainPipeline,
        steps_per_dispatch: int | Literal["auto"] = 1,
        *,
        measured_before: bool = False,
    ) -> Callable[[], Measured]:
        def run() -> Measured:
            result = fit_once(
                fresh_state(),
                step,
                on,
                steps=steps,
                n=steps_per_dispatch,
                measured_before=measured_before,
            )
            fit_stats["input_wait_fraction"].append(result.input_wait_fraction)
            fit_stats["compiles"].append(result.train_step_compiles)
            if steps_per_dispatch == "auto":
                auto_chose.append(result.dispatch)
            # Wall time from the end of the first step, as for the hand loops: the
            # compiles of later chunk sizes and auto's measurement count.
            return Measured((steps - 1) / result.steps_per_second)

        return run

    candidates = {
        "bare step": bare,
        "gather + device_put": gather_and_put,
        "fit": fit(pipeline),
        "fit resident": fit(resident),
        **{f"fit resident N={n}": fit(resident, n) for n in FIT_CHUNKS},
        "fit resident N=auto, measured before": fit(resident, "auto", measured_before=True),
    }
    timings = interleave(candidates, rounds=ROUNDS, warmup=1)
    title = f"{name}, batch {batch}, {mesh.size} device(s), {steps} steps a round"
    result = report(title, timings, baseline="bare step", unit=f"{steps - 1} steps")
    rate = {key: (steps - 1) / t.median for key, t in timings.items()}
    per_step = {key: 1e6 / r for key, r in rate.items()}
    result.update(
        steps_per_second=rate,
        fit_over_gather_and_put=timings["gather + device_put"].total / timings["fit"].total,
        fit_over_bare=timings["bare step"].total / timings["fit"].total,
        fit_overhead_us_vs_bare=per_step["fit"] - per_step["bare step"],
        fit_overhead_us_vs_gather_and_put=per_step["fit"] - per_step["gather + device_put"],
        fit_input_wait_fraction=max(fit_stats["input_wait_fraction"]),
        fit_train_step_compiles_per_run=fit_stats["compiles"],
        over_bare={key: timings["bare step"].total / t.total for key, t in timings.items()},
        auto_chose=sorted(set(auto_chose)),
    )
    print(
        "steps/s: "
        + ", ".join(f"{key} {value:,.0f}" for key, value in rate.items())
        + f"\nfit / gather + device_put {result['fit_over_gather_and_put']:.2f}x, "
        f"fit / bare {result['fit_over_bare']:.2f}x (rates, from totals); "
        f"fit overhead per step {result['fit_overhead_us_vs_bare']:.0f} us vs bare, "
        f"{result['fit_overhead_us_vs_gather_and_put']:.0f} us vs gather + device_put; "
        f"train step compiles per fit run {sorted(set(fit_stats['compiles']))}\n"
        "rate / bare step: "
        + ", ".join(f"{key} {value:.2f}x" for key, value in result["over_bare"].items())
        + f"\nauto chose: {result['auto_chose']}"
    )
    return result


def ensemble_case(mesh, *, members: int, batch: int, steps: int) -> dict:
    """The Flax ensembling HOWTO's setting on the tiny MLP: ``members`` members on the
    ``ensemble`` axis, one shared batch; the bare ensemble step over placed batches
    against ``fit`` with host input (today's default) and resident data at 1, 32 and
    ``'auto'`` steps per dispatch."""
    from meshkit import ensemble

    size = mesh.size if members % mesh.size == 0 else 1
    layout = ensemble.EnsembleLayout(
        meshkit.make_mesh(f"ensemble={size},data={mesh.size // size}", devices=mesh.devices.flat),
        members,
    )
    source = data.digits("train", image_size=8)
    model = train.linen_model(TinyMLP(), jnp.zeros((1, 8, 8, 1)))
    tx = optax.sgd(0.05, momentum=0.9)

    def fresh_state():
        return ensemble.create_ensemble_state(model, tx, layout)

    step = ensemble.make_ensemble_step(ensemble.classification_loss, layout)
    options = {"global_batch_size": batch, "sharding": layout.batch_sharding, "seed": 0}
    host = data.TrainPipeline(source, **options)
    resident = data.TrainPipeline(
        source, **options, input_settings=data.InputSettings(resident=True)
    )
    placed = [jax.device_put(host.local_batch(k), layout.batch_sharding) for k in range(16)]
    wait = ON_CPU and mesh.size > 1
    auto_chose: list[str] = []

    def fit(on: data.TrainPipeline, n: int | Literal["auto"] = 1) -> Callable[[], Measured]:
        def run() -> Measured:
            result = fit_once(fresh_state(), step, on, steps=steps, n=n)
            if n == "auto":
                auto_chose.append(result.dispatch)
            return Measured((steps - 1) / result.steps_per_second)

        return run

    candidates = {
        "bare step": lambda: hand_loop(
            step, fresh_state(), lambda k: placed[k % 16], steps, wait=wait
        ),
        "fit": fit(host),
        "fit resident": fit(resident),
        "fit resident N=32": fit(resident, 32),
        "fit resident N=auto": fit(resident, "auto"),
    }
    timings = interleave(candidates, rounds=ROUNDS, warmup=1)
    title = (
        f"ensemble of {members} tiny MLPs ({layout!r}), batch {batch}, {mesh.size} device(s), "
        f"{steps} steps a round"
    )
    result = report(title, timings, baseline="bare step", unit=f"{steps - 1} steps")
    result.update(
        over_bare={key: timings["bare step"].total / t.total for key, t in timings.items()},
        over_fit={key: timings["fit"].total / t.total for key, t in timings.items()},
        auto_chose=sorted(set(auto_chose)),
    )
    print(
        "rate / bare step: "
        + ", ".join(f"{key} {value:.2f}x" for key, value in result["over_bare"].items())
        + "\nrate / fit (host input): "
        + ", ".join(f"{key} {value:.2f}x" for key, value in result["over_fit"].items())
        + f"\nauto chose: {result['auto_chose']}"
    )
    return result


def placement(mesh, *, image_size: Literal[8, 28], batch: int, calls: int = 300) -> dict:
    """``meshkit.shard_batch`` against a plain ``jax.device_put`` with the same sharding."""
    sharding = meshkit.batch_sharding(mesh)
    source = data.digits("train", image_size=image_size)
    pipeline = data.TrainPipeline(source, global_batch_size=batch, sharding=sharding, seed=0)
    local = pipeline.local_batch(0)

    def timed(place: Callable[[], Any]) -> Measured:
        started = time.perf_counter()
        jax.block_until_ready([place() for _ in range(calls)])
        return Measured((time.perf_counter() - started) / calls)

    candidates = {
        "jax.device_put": lambda: timed(lambda: jax.device_put(local, sharding)),
        "meshkit.shard_batch": lambda: timed(
            lambda: meshkit.shard_batch(local, sharding, global_batch_size=batch)
        ),
    }
    timings = interleave(candidates, rounds=ROUNDS, warmup=1)
    title = (
        f"placing one batch of {batch} images of {image_size}x{image_size}, {mesh.size} device(s)"
    )
    return report(title, timings, baseline="jax.device_put", unit="batch")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", default="mlp,cnn,ensemble", help="which cases: mlp, cnn, ensemble"
    )
    models = parser.parse_args(argv).models.split(",")
    one = meshkit.make_mesh("data=1", devices=jax.devices()[:1])
    meshes = [one, meshkit.make_mesh("data=-1")] if ON_CPU and jax.device_count() > 1 else [one]
    results = []
    for mesh in meshes:
        steps = 4000 if not ON_CPU else (4000 if mesh.size == 1 else 1200)
        if "mlp" in models:
            results.append(
                case(
                    "tiny MLP, 8x8 digits",
                    TinyMLP(),
                    image_size=8,
                    batch=64,
                    mesh=mesh,
                    steps=steps,
                )
            )
        if "ensemble" in models:
            results.append(
                ensemble_case(mesh, members=8, batch=64, steps=steps if ON_CPU else 2000)
            )
        if "cnn" not in models:
            continue
        steps = 2000 if not ON_CPU else 96
        results.append(
            case(
                "MNIST CNN, 28x28 digits",
                MnistCNN(),
                image_size=28,
                batch=128,
                mesh=mesh,
                steps=steps,
            )
        )
    placements = [placement(mesh, image_size=8, batch=64) for mesh in meshes] + [
        placement(mesh, image_size=28, batch=128) for mesh in meshes
    ]
    save("fit_overhead", {"cases": results, "placement": placements})


if __name__ == "__main__":
    main()
