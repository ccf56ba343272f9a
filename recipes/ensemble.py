"""The Flax ensembling HOWTO: K MNIST CNNs trained side by side on an ``ensemble`` mesh axis.

Command (no arguments: 8 members of the Flax ensembling HOWTO's MNIST CNN on the embedded digits,
resized to 28×28, on 8 fake CPU devices; the mesh is ``ensemble=8``, one member per
device, the HOWTO's layout)::

    python -m recipes.ensemble

Expected result, in under a minute on a 2-core machine: the layout, a progress bar, then
a JSON summary (also written to ``<workdir>/summary.json``) over all 360 test digits,
where the ensemble (the average of its members' probabilities) is at least as accurate
as its best member, e.g.::

    EnsembleLayout(num_members=8, ensemble=8, data=1, members_per_device=1)
    {"members": 8, "mesh": {"ensemble": 8, "data": 1}, ..., "test_examples": 360,
     "ensemble_test_accuracy": 0.9889, "best_member_test_accuracy": 0.9639,
     "member_test_accuracy": [0.9472, 0.9111, 0.9639, ...], ...}

Other runs::

    python -m recipes.ensemble --members 16                    # two members per device
    python -m recipes.ensemble --mesh ensemble=4,data=2        # each batch over 2 devices
    python -m recipes.ensemble --same-batches                  # the HOWTO's shared batches
    python -m recipes.ensemble --dataset mnist --data-dir ~/mnist --steps 2000
    python -m recipes.ensemble --precision bf16 --lr-schedule cosine --tensorboard
    python -m recipes.ensemble --precision f16 --microbatches 2  # a loss scale per member

The HOWTO's settings are the defaults: SGD with learning rate 0.1 and momentum 0.9,
batch size 32. Each member visits the training set in its own order (more diverse
members, a better ensemble: measured in docs/ensembles.md); ``--same-batches`` gives
every member the same batch, as the HOWTO does. Rerunning with the
same ``--workdir`` resumes from its last checkpoint; a SIGTERM saves and exits with
code 75. On several processes the script is unchanged (see ``recipes.data_parallel``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import meshkit
from recipes._args import (
    add_input_options,
    add_training_options,
    fit_options,
    fraction,
    hyperparameters,
    learning_rate_schedule,
    positive_float,
    positive_int,
    recipe_parser,
    run_errors_in_one_line,
    run_summary,
    setup_errors_in_one_line,
    start_run,
    write_summary,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(__doc__, workdir="workdir/ensemble", progress=True, resumes=True)
    parser.add_argument("--members", type=positive_int, default=8, help="ensemble size K")
    parser.add_argument(
        "--mesh",
        default="auto",
        help="mesh axes, e.g. ensemble=4,data=2; 'auto' puts gcd(K, devices) devices on "
        "'ensemble' and the rest on 'data'",
    )
    parser.add_argument("--dataset", default="digits", choices=["digits", "mnist"])
    parser.add_argument("--data-dir", type=Path, help="folder with the MNIST IDX files")
    parser.add_argument(
        "--same-batches",
        action="store_true",
        help="every member trains on the same batches, as in the Flax ensembling HOWTO "
        "(default: each member visits the data in its own order)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32, help="global batch size")
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--learning-rate", type=positive_float, default=0.1)
    parser.add_argument("--momentum", type=fraction, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=positive_int, default=None)
    parser.add_argument("--checkpoint-every", type=positive_int, default=None)
    add_training_options(parser)
    add_input_options(parser)
    return parser.parse_args(argv)


def mesh_axes(spec: str, members: int, devices: int) -> str:
    """``auto``: as many devices on ``ensemble`` as divide both K and the device count."""
    if spec != "auto":
        return spec
    size = math.gcd(members, devices)
    return f"ensemble={size},data={devices // size}"


def load_data(args: argparse.Namespace):
    import numpy as np

    from meshkit import data

    if args.dataset == "digits":
        return tuple(data.digits(split, image_size=28) for split in ("train", "test"))
    if args.data_dir is None:
        raise SystemExit("--dataset mnist reads the IDX files you have: pass --data-dir.")
    sources = []
    for split in ("train", "test"):
        source = data.mnist(args.data_dir, split)
        arrays = source.getitems(np.arange(len(source)))
        images = arrays["image"].astype(np.float32) / 255.0  # as the HOWTO's input pipeline
        sources.append(data.ArraySource({"image": images, "label": arrays["label"]}, name=split))
    return tuple(sources)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax
    import jax.numpy as jnp
    import optax

    from meshkit import data, ensemble, train
    from meshkit.models import MnistCNN

    with setup_errors_in_one_line():  # a --data-dir without the dataset's files
        train_source, test_source = load_data(args)
    try:
        mesh = meshkit.make_mesh(mesh_axes(args.mesh, args.members, jax.device_count()))
        layout = ensemble.EnsembleLayout(mesh, args.members)
    except ValueError as error:  # says what was received and how to fix it
        raise SystemExit(f"--members {args.members} --mesh {args.mesh}: {error}") from None
    start_run(args, mesh)  # a changed rerun stops here; a finished one ends here
    pipeline_args = {
        "global_batch_size": args.batch_size,
        "sharding": layout.batch_sharding,
        "seed": args.seed,
        # one copy of the data on the devices serves every member
        "input_settings": data.InputSettings(resident=args.input == "resident"),
    }
    with setup_errors_in_one_line():
        if args.same_batches:
            pipeline = data.TrainPipeline(train_source, **pipeline_args)
        else:
            pipeline = ensemble.MemberTrainPipeline(train_source, args.members, **pipeline_args)
    eval_pipeline = data.EvalPipeline(
        test_source, global_batch_size=max(args.batch_size, 128), sharding=layout.batch_sharding
    )
    model = train.linen_model(MnistCNN(), jnp.zeros((1, *train_source[0]["image"].shape)))
    schedule = learning_rate_schedule(args)
    tx = optax.sgd(schedule, momentum=args.momentum)
    state = ensemble.create_ensemble_state(
        model, tx, layout, seed=args.seed, precision=args.precision
    )
    step = ensemble.make_ensemble_step(
        ensemble.classification_loss,
        layout,
        member_batches=not args.same_batches,
        microbatches=args.microbatches,
    )
    if jax.process_index() == 0:
        print(layout, flush=True)

    with run_errors_in_one_line():
        result = train.fit(
            state,
            step,
            pipeline,
            num_steps=args.steps,
            workdir=args.workdir,
            evaluation=train.Evaluation(
                eval_pipeline,
                every=args.eval_every,
                per_example_fn=ensemble.ensemble_metrics(layout),
            ),
            checkpoints=train.Checkpoints(every=args.checkpoint_every or args.steps),
            **fit_options(args, schedule),
        )
    summary = summarize(args, layout, result)
    write_summary(args.workdir, summary)
    return train.PREEMPTED_EXIT_CODE if result.preempted else 0


def summarize(args: argparse.Namespace, layout, result) -> dict:
    import jax

    from meshkit import ensemble

    evaluation = result.eval_metrics  # empty if a SIGTERM stopped the run before evaluating
    member_accuracy = ensemble.per_member(evaluation, "accuracy").tolist() if evaluation else []
    member_loss = ensemble.per_member(evaluation, "loss").tolist() if evaluation else []
    return {
        "members": layout.num_members,
        "mesh": dict(layout.mesh.shape),
        "members_per_device": layout.members_per_device,
        "same_batches": args.same_batches,
        "dataset": args.dataset,
        "processes": jax.process_count(),
        "hyperparameters": hyperparameters(args, "same_batches"),
        **run_summary(result),
        "test_examples": evaluation.get("count"),
        "ensemble_test_accuracy": evaluation.get("ensemble_accuracy"),
        "ensemble_test_loss": evaluation.get("ensemble_loss"),
        "best_member_test_accuracy": max(member_accuracy, default=None),
        "mean_member_test_accuracy": evaluation.get("accuracy"),
        "member_test_accuracy": member_accuracy,
        "member_test_loss": member_loss,
    }


if __name__ == "__main__":
    sys.exit(main())
