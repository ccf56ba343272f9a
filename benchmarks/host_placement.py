"""Who should copy host batches to the devices: the training loop, or a thread of its own.

    python -m benchmarks host_placement      # any backend; on CPU, 1 and 8 fake devices

``fit`` over the same in-memory ``TrainPipeline`` (host input, not resident), the same
jitted step and a fresh state every round, with ``InputSettings(placement=...)``:

- ``loop``: the training loop places each batch itself, queued asynchronously a few
  batches ahead;
- ``thread``: a placing thread keeps the next batches (or chunk) placed and the loop
  only dispatches;

each at one step per dispatch and at 32 (host chunks), interleaved A B A B, 10 timed
rounds after one warm-up. Ratios are thread / loop rates, from totals. ``'auto'``
chooses the thread on GPUs and TPUs and the loop on CPUs; this benchmark is what
that choice answers to on each backend. Models: the tiny MLP on the 8×8 digits (batch
64: the input work dominates), and on accelerators the MNIST CNN of the Flax
ensembling HOWTO on the digits at 28×28 (batch 128).
"""

from __future__ import annotations

import meshkit

meshkit.distributed.initialize(cpu_devices=8)

from collections.abc import Callable  # noqa: E402
from typing import Any, Literal  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    Measured,
    TinyMLP,
    digits_classifier,
    fit_once,
    interleave,
    report,
    save,
)
from benchmarks.quoted import markdown_table  # noqa: E402
from meshkit import data  # noqa: E402
from meshkit.models import MnistCNN  # noqa: E402

ON_CPU = jax.devices()[0].platform == "cpu"
ROUNDS = 10
PLACEMENTS: tuple[Literal["loop", "thread"], ...] = ("loop", "thread")
STEPS_PER_DISPATCH = (1, 32)


def case(
    name: str, module: nn.Module, *, image_size: Literal[8, 28], batch: int, mesh, steps: int
) -> dict[str, Any]:
    sharding = meshkit.batch_sharding(mesh)
    source, fresh_state, step = digits_classifier(module, image_size=image_size, mesh=mesh)
    pipelines = {
        placement: data.TrainPipeline(
            source,
            global_batch_size=batch,
            sharding=sharding,
            seed=0,
            input_settings=data.InputSettings(placement=placement),
        )
        for placement in PLACEMENTS
    }

    def fit(placement: str, n: int) -> Callable[[], Measured]:
        def run() -> Measured:
            result = fit_once(fresh_state(), step, pipelines[placement], steps=steps, n=n)
            return Measured((steps - 1) / result.steps_per_second)

        return run

    candidates = {
        f"{placement}, N={n}": fit(placement, n)
        for n in STEPS_PER_DISPATCH
        for placement in PLACEMENTS
    }
    timings = interleave(candidates, rounds=ROUNDS, warmup=1)
    title = f"{name}, batch {batch}, {mesh.size} device(s), {steps} steps a round"
    result = report(title, timings, baseline="loop, N=1", unit=f"{steps - 1} steps")
    thread_over_loop = {
        n: timings[f"loop, N={n}"].total / timings[f"thread, N={n}"].total
        for n in STEPS_PER_DISPATCH
    }
    result.update(
        thread_over_loop=thread_over_loop,
        steps_per_second={key: (steps - 1) / t.median for key, t in timings.items()},
    )
    print(
        "thread / loop (rates, from totals): "
        + ", ".join(f"N={n} {ratio:.2f}x" for n, ratio in thread_over_loop.items())
    )
    return result


def main() -> None:
    one = meshkit.make_mesh("data=1", devices=jax.devices()[:1])
    meshes = [one, meshkit.make_mesh("data=-1")] if ON_CPU and jax.device_count() > 1 else [one]
    results = []
    for mesh in meshes:
        steps = 4000 if mesh.size == 1 or not ON_CPU else 1200
        results.append(
            case("tiny MLP, 8x8 digits", TinyMLP(), image_size=8, batch=64, mesh=mesh, steps=steps)
        )
        if not ON_CPU:  # on a CPU the CNN's step is compute-bound: placement is noise
            results.append(
                case(
                    "MNIST CNN, 28x28 digits",
                    MnistCNN(),
                    image_size=28,
                    batch=128,
                    mesh=mesh,
                    steps=2000,
                )
            )
    save(
        "host_placement",
        {"cases": results, "auto_chooses": "loop" if ON_CPU else "thread"},
        tables,
    )


def tables(run: dict[str, Any]) -> dict[str, str]:
    """``table``: ``fit``'s host-input rate with the loop's placement and with a placing
    thread, at 1 and 32 steps per dispatch, and thread / loop from totals."""
    rows = []
    for case in run["cases"]:
        rate = case["steps_per_second"]
        cells = [case["title"]]
        for n, ratio in case["thread_over_loop"].items():
            cells += [f"{rate[f'loop, N={n}']:,.0f}", f"{rate[f'thread, N={n}']:,.0f}"]
            cells.append(f"**{float(ratio):.2f}×**")
        rows.append(cells)
    header = ["case", "loop, N=1 (steps/s)", "thread, N=1", "thread / loop"]
    header += ["loop, N=32", "thread, N=32", "thread / loop"]
    return {"table": markdown_table(header, rows)}


if __name__ == "__main__":
    main()
