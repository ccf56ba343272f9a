"""A hyperparameter sweep as one program: 16 settings of the digits CNN on the ensemble axis.

Command (no arguments: the MNIST CNN of the Flax examples on the embedded 8×8 digits,
AdamW with a 4 × 4 log grid of learning rate × weight decay, 16 members, two per
device on 8 fake CPU devices, one compile)::

    python -m recipes.sweep

Expected result, in about a minute on a 2-core machine: a progress bar, the ranked
table, and a JSON summary (also in ``<workdir>/summary.json``) whose best member
reaches at least 0.97 test accuracy with a train step compiled once, e.g.::

    rank  trial  slot  status    accuracy  learning_rate  weight_decay
       1     11    11  finished    0.9889        0.02154          0.01
       2      8     8  finished    0.9833        0.02154         1e-05
    ...
    {"points": 16, "mesh": {"ensemble": 8, "data": 1}, "train_step_compiles": 1,
     "best": {"learning_rate": 0.02154, "weight_decay": 0.01}, "best_test_accuracy": 0.9889, ...}

The sweep writes ``<workdir>/results.json`` (every trial, best first, with its
hyperparameters and scores), ``<workdir>/sweep.png`` (members' training loss and
evaluation accuracy, the winner highlighted) and ``<workdir>/best`` (the winner as an
ordinary train-state checkpoint with ``hyperparameters.json``).

Other runs::

    python -m recipes.sweep --pbt                     # population-based training
    python -m recipes.sweep --halving                 # successive halving with refill
    python -m recipes.sweep --mesh ensemble=4,data=2  # each member's batch over 2 devices
    python -m recipes.sweep --precision bf16 --microbatches 2
    python -m recipes.sweep --slice 0/2 --workdir workdir/sweep_0  # half the points
    python -m meshkit.sweep merge workdir/sweep_0 workdir/sweep_1  # ranked as one table

Each mode has its own default workdir (``workdir/sweep``, ``workdir/sweep_pbt``,
``workdir/sweep_halving``). Rerunning with the same ``--workdir`` resumes: a sweep
killed at any point ends with the same table as one never interrupted; a rerun with
other settings stops in one line naming them (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import sys

import meshkit
from recipes._args import (
    RUN_FILES,
    add_input_options,
    positive_int,
    recipe_parser,
    run_errors_in_one_line,
    setup_errors_in_one_line,
    start_run,
    workdir_path,
    write_summary,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(__doc__, workdir="workdir/sweep", progress=True, resumes=True)
    parser.set_defaults(workdir=None)  # by mode: workdir/sweep, workdir/sweep_pbt, ...
    parser.add_argument("--mesh", default="ensemble=8,data=1", help="mesh axes")
    schedule = parser.add_mutually_exclusive_group()
    schedule.add_argument(
        "--pbt",
        action="store_true",
        help="population-based training: at a third and two thirds of "
        "the steps the bottom quarter copies the top quarter and perturbs its values",
    )
    schedule.add_argument(
        "--halving",
        action="store_true",
        help="successive halving at a third and two thirds of the "
        "steps; stopped slots restart with new points from the space",
    )
    parser.add_argument("--steps", type=positive_int, default=150)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="global batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32")
    parser.add_argument("--microbatches", type=positive_int, default=1)
    parser.add_argument(
        "--slice",
        type=slice_of,
        default=(0, 1),
        metavar="I/N",
        help="train only every N-th point from the I-th (0 <= I < N), e.g. "
        "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT in a job array; merge the slices' "
        "tables with python -m meshkit.sweep merge (default: 0/1, every point)",
    )
    # One step per dispatch: one compiled program for the whole sweep (auto adds its
    # probe's and its choice's sizes).
    add_input_options(parser, steps_per_dispatch=1)
    args = parser.parse_args(argv)
    if args.workdir is None:  # each mode its own run, so the documented commands follow on
        mode = "_pbt" if args.pbt else "_halving" if args.halving else ""
        args.workdir = workdir_path(f"workdir/sweep{mode}")
    return args


def slice_of(text: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)``, checked."""
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N in I/N, got {text!r}")
    return i, n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax
    import jax.numpy as jnp
    import optax

    from meshkit import data, ensemble, sweep, train
    from meshkit.models import MnistCNN

    space = sweep.Space(
        learning_rate=sweep.log_grid(1e-3, 1e-1, 4), weight_decay=sweep.log_grid(1e-5, 1e-2, 4)
    )
    index, count = args.slice
    points = space.grid()[index::count]
    if not points:
        raise SystemExit(f"--slice {index}/{count}: no points; the grid has {len(space.grid())}")
    try:
        layout = ensemble.EnsembleLayout(meshkit.make_mesh(args.mesh), len(points))
    except ValueError as error:  # says what was received and how to fix it
        raise SystemExit(f"--mesh {args.mesh}: {error}") from None
    # A sweep's record is sweep.json: a rerun with other settings stops here, in one line;
    # --fresh deletes the sweep's own files too (its record, stages, results and best).
    start_run(
        args,
        layout.mesh,
        resuming=(args.workdir / "sweep.json").exists(),
        finished=False,
        run_files=(*RUN_FILES, "sweep.json", "stage_*", "results.json", "best", "sweep.png"),
    )
    train_source, test_source = data.digits("train"), data.digits("test")
    schedule = None
    if args.pbt:
        schedule = sweep.PopulationBasedTraining(every=max(args.steps // 3, 1))
    elif args.halving:
        rungs = sorted({max(args.steps // 3, 1), max(2 * args.steps // 3, 1)} - {args.steps})
        schedule = sweep.SuccessiveHalving(rungs=tuple(rungs), refill=True)
    with setup_errors_in_one_line():
        pipeline = sweep.sweep_pipeline(
            train_source,
            points,
            layout,
            global_batch_size=args.batch_size,
            seed=args.seed,
            input_settings=data.InputSettings(resident=args.input == "resident"),
        )
    experiment = sweep.Sweep(
        train.linen_model(MnistCNN(), jnp.zeros((1, 8, 8, 1))),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4),
        ensemble.classification_loss,
        layout,
        points,
        schedule=schedule,
        space=space,
        seed=args.seed,
        precision=args.precision,
        microbatches=args.microbatches,
    )
    with run_errors_in_one_line():
        result = sweep.run_sweep(
            experiment,
            pipeline=pipeline,
            evaluation=train.Evaluation(
                data.EvalPipeline(
                    test_source, global_batch_size=128, sharding=layout.batch_sharding
                )
            ),
            num_steps=args.steps,
            workdir=args.workdir,
            logging=train.Logging(progress=not args.no_progress),
            dispatch=train.Dispatch(steps_per_dispatch=args.steps_per_dispatch),
        )
    if result.interrupted:  # a SIGTERM: saved; rerun to resume
        return train.PREEMPTED_EXIT_CODE
    result.save_best()
    best = result.best
    if jax.process_index() == 0:
        result.plot(args.workdir / "sweep.png")
        print(result.table(), flush=True)
        print(
            f"written: {args.workdir / 'results.json'} (every trial, its scores and lineage), "
            f"{args.workdir / 'sweep.png'} (the curves), {args.workdir / 'best'} (the "
            "winner's checkpoint and hyperparameters)",
            flush=True,
        )
    write_summary(
        args.workdir,
        {
            "points": len(points),
            "slice": f"{index}/{count}",
            "trials": len(result.trials),
            "mesh": dict(layout.mesh.shape),
            "processes": jax.process_count(),
            "schedule": "pbt" if args.pbt else "halving" if args.halving else None,
            "steps": result.step,
            "train_step_compiles": result.train_step_compiles,
            "input": result.input_path,
            "wall_seconds": round(result.wall_seconds, 2),
            "best": best.point,
            "best_trial": best.id,
            "best_test_accuracy": best.metrics.get("accuracy"),
            "best_test_loss": best.metrics.get("loss"),
            "results": str(args.workdir / "results.json"),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
