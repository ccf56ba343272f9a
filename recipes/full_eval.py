"""The Flax full-evaluation notebook's question on the digits: which evaluation counts all?

Command (no arguments: trains a small CNN on the digits for 150 steps, then evaluates
the 360 test digits four ways with a global batch of 64, on 8 fake CPU devices)::

    python -m recipes.full_eval

Expected result: a table like this (the accuracy depends on the training run, but the
exact methods agree with each other and the counts and compiles are always these)::

    method                               examples  accuracy  compiles
    simple batching, keep remainder           360    0.9722         2
    drop_remainder                            320    0.9719         1
    meshkit.evaluate.pad_shard_unpad          360    0.9722         1
    meshkit.evaluate.full_eval                360    0.9722         1

Simple batching is exact but recompiles for the short last batch and runs on one
device; dropping the remainder keeps one shape but silently skips 40 of the 360
digits; padding with a mask is exact, sharded and compiles once. A JSON summary is
written to ``<workdir>/summary.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

import meshkit
from recipes._args import make_mesh, positive_int, recipe_parser, setup_errors_in_one_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(__doc__, workdir="workdir/full_eval", progress=True)
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, help="global eval batch size"
    )
    parser.add_argument("--train-steps", type=positive_int, default=150)
    parser.add_argument("--mesh", default="data=-1")
    return parser.parse_args(argv)


def train_model(mesh: Any, steps: int, *, progress: bool = True) -> Any:
    """NormCNN (batch norm, dropout) trained on the 1,437 training digits."""
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    from meshkit import data, train
    from meshkit.models import NormCNN

    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding)
    model = train.linen_model(NormCNN(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(model, optax.sgd(0.05, momentum=0.9), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    with data.GlobalBatchIterator(pipeline) as batches:
        shown = progress and jax.process_index() == 0
        for _ in tqdm(range(steps), desc="training", unit="step", disable=not shown):
            state, metrics = step(state, next(batches))
            float(metrics["loss"])  # one step in flight
    return state


def methods(
    state: Any, mesh: Any, test: dict[str, Any], batch: int
) -> dict[str, Callable[[], tuple[int, int]]]:
    """The four ways to evaluate, each returning (correct, examples counted)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshkit import evaluate

    sharding = meshkit.batch_sharding(mesh)
    n = len(test["label"])

    def jitted_logits() -> Callable[[Any, Any], jax.Array]:
        """A fresh jitted function per method, so no method reuses another's compilation."""

        def logits(state: Any, images: jax.Array) -> jax.Array:
            return state.apply_fn(state.variables(), images)

        return jax.jit(logits)

    def simple_batching() -> tuple[int, int]:
        predict = jitted_logits()
        local_state = jax.device_put(meshkit.to_host(state), jax.local_devices()[0])
        correct = 0
        for start in range(0, n, batch):
            predictions = np.asarray(predict(local_state, test["image"][start : start + batch]))
            correct += int((predictions.argmax(-1) == test["label"][start : start + batch]).sum())
        return correct, n

    def drop_remainder() -> tuple[int, int]:
        predict = jitted_logits()
        correct = total = 0
        rows = meshkit.data_shard(sharding, batch).slice  # this process's rows of a batch
        for start in range(0, n - n % batch, batch):
            mine = test["image"][start : start + batch][rows]
            images = meshkit.shard_batch(mine, sharding, global_batch_size=batch)
            predictions = meshkit.to_host(predict(state, images)).argmax(-1)
            correct += int((predictions == test["label"][start : start + batch]).sum())
            total += batch
        return correct, total

    def padded() -> tuple[int, int]:
        predict = evaluate.pad_shard_unpad(jitted_logits(), mesh, min_batch=batch)
        correct = 0
        for start in range(0, n, batch):
            predictions = predict(state, test["image"][start : start + batch]).argmax(-1)
            correct += int((predictions == test["label"][start : start + batch]).sum())
        return correct, n

    def exact() -> tuple[int, int]:
        def correct(state: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
            predictions = state.apply_fn(state.variables(), batch["image"]).argmax(-1)
            return {"correct": (predictions == batch["label"]).astype(jnp.float32)}

        result = evaluate.full_eval(correct, state, test, mesh=mesh, batch_size=batch)
        return round(result.metrics["correct"] * result.count), result.count

    return {
        "simple batching, keep remainder": simple_batching,
        "drop_remainder": drop_remainder,
        "meshkit.evaluate.pad_shard_unpad": padded,
        "meshkit.evaluate.full_eval": exact,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax

    from meshkit import data, train

    mesh = make_mesh(args.mesh)
    with setup_errors_in_one_line():  # another run in the workdir, or files not meshkit's
        train.claim_workdir(args.workdir, writes=("summary.json",))
    state = train_model(mesh, args.train_steps, progress=not args.no_progress)
    test = data.digits("test").arrays
    summary = {}
    for name, run in methods(state, mesh, test, args.batch_size).items():
        with meshkit.count_compiles() as log:
            correct, total = run()
        # The evaluation's own programs; on several processes, the gathers that bring
        # results to the host compile small programs of JAX's too, counted apart.
        compiles = log.count("logits") + log.count("eval_step")
        summary[name] = {"examples": total, "accuracy": correct / total, "compiles": compiles}
    if jax.process_index() == 0:
        print(f"{'method':<36} {'examples':>8}  {'accuracy':>8}  {'compiles':>8}")
        for name, row in summary.items():
            print(f"{name:<36} {row['examples']:>8}  {row['accuracy']:>8.4f}  {row['compiles']:>8}")
        args.workdir.mkdir(parents=True, exist_ok=True)
        (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"The summary is in {args.workdir / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
