"""Data-parallel training as sharded jit: a cluster wiki's Flax program, resumable.

Command (no arguments: the Flax ensembling HOWTO's MNIST CNN on the embedded digits,
resized to 28×28, on 8 fake CPU devices, mesh ``data=-1``)::

    python -m recipes.data_parallel

Expected result, in well under 2 minutes on a 2-core machine: a progress bar, then a
JSON summary (also written to ``<workdir>/summary.json``) with a test accuracy above
0.95 over all 360 test digits, e.g.::

    {"model": "mnist_cnn", "dataset": "digits", "steps": 200, "test_accuracy": 0.98..., ...}

Other runs::

    python -m recipes.data_parallel --model cifar_net            # the wiki's net, 32×32×3
    python -m recipes.data_parallel --dataset cifar10 --model cifar_net --data-dir ~/cifar
    python -m recipes.data_parallel --dataset mnist --data-dir ~/mnist --steps 2000
    python -m recipes.data_parallel --mesh data=4,model=2 --rules fsdp
    python -m recipes.data_parallel --precision bf16 --microbatches 4 --tensorboard
    python -m recipes.data_parallel --reduction ordered   # the same bits on any layout
    python -m recipes.data_parallel --input host --steps-per-dispatch 1   # each batch from the host
    python -m recipes.data_parallel --lr-schedule cosine --warmup-steps 20 --profile-steps 50,5

The bfloat16 run with 4 micro-batches also reaches a test accuracy above 0.95; its
workdir holds a TensorBoard event file (``tensorboard/``), ``config.json`` (every
argument, the mesh, the devices and the package versions) and ``summary.json``.

The training set lives on the devices (``--input resident``: each batch is gathered
there by index, the same batches as ``--input host``) and the steps run several per
compiled program (``--steps-per-dispatch auto``); the summary's ``input`` says which
layout and how many steps, e.g. ``"resident (replicated, 4.3 MiB per device), 1 step
per dispatch (auto: 30 ms per step; a chunk of it would be written out step by step on a
CPU, so none was timed)"`` on 8 CPU devices,
many steps on an accelerator.

Rerunning with the same ``--workdir`` resumes from its last checkpoint. A SIGTERM saves
and exits with code 75. On several processes the script is unchanged:
``meshkit.distributed.initialize()`` detects SLURM (``srun python -m
recipes.data_parallel ...``), TPU pods (``gcloud compute tpus tpu-vm ssh ... --worker=all
--command "python -m recipes.data_parallel ..."``) and explicit coordinator settings.
"""

from __future__ import annotations

import argparse
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
    make_mesh,
    positive_float,
    positive_int,
    recipe_parser,
    run_errors_in_one_line,
    run_summary,
    setup_errors_in_one_line,
    start_run,
    write_summary,
)

DATASETS = {"digits", "mnist", "fashion_mnist", "cifar10"}
IMAGE_SHAPES = {"mnist_cnn": (28, 28, 1), "cifar_net": (32, 32, 3), "norm_cnn": (8, 8, 1)}
"""The digits are resized to the input each model was built for."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(__doc__, workdir="workdir/data_parallel", progress=True, resumes=True)
    parser.add_argument("--model", default="mnist_cnn", help="mnist_cnn | cifar_net | norm_cnn")
    parser.add_argument("--dataset", default="digits", choices=sorted(DATASETS))
    parser.add_argument("--data-dir", type=Path, help="folder with MNIST IDX or CIFAR-10 files")
    parser.add_argument("--mesh", default="data=-1", help="mesh axes, e.g. data=4,model=2")
    parser.add_argument("--rules", choices=["replicated", "fsdp"], default="replicated")
    parser.add_argument(
        "--reduction",
        choices=["all_reduce", "ordered"],
        default="all_reduce",
        help="ordered: gradients added in device order, the same bits on 1 x 8 and 2 x 4",
    )
    parser.add_argument("--batch-size", type=positive_int, default=128, help="global batch size")
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--learning-rate", type=positive_float, default=0.05)
    parser.add_argument("--momentum", type=fraction, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=positive_int, default=100)
    parser.add_argument("--checkpoint-every", type=positive_int, default=100)
    add_training_options(parser)
    add_input_options(parser)
    return parser.parse_args(argv)


def load_data(args: argparse.Namespace, image_shape: tuple[int, int, int] | None):
    from meshkit import data

    if image_shape is not None:
        size, _, channels = image_shape
        return tuple(
            data.digits(split, image_size=size, channels=channels)  # type: ignore[arg-type]
            for split in ("train", "test")
        )
    if args.data_dir is None:
        raise SystemExit(f"--dataset {args.dataset} reads files you have: pass --data-dir.")
    reader = {"mnist": data.mnist, "fashion_mnist": data.fashion_mnist, "cifar10": data.cifar10}[
        args.dataset
    ]
    return tuple(reader(args.data_dir, split) for split in ("train", "test"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from meshkit import data, train
    from meshkit.models import MODELS

    if args.model not in MODELS:
        raise SystemExit(f"Unknown --model {args.model!r}; choose one of {sorted(MODELS)}.")
    image_shape = IMAGE_SHAPES[args.model] if args.dataset == "digits" else None
    with setup_errors_in_one_line():  # a --data-dir without the dataset's files
        train_source, test_source = load_data(args, image_shape)

    mesh = make_mesh(args.mesh)
    start_run(args, mesh)  # a changed rerun stops here; a finished one ends here
    batch_sharding = meshkit.batch_sharding(mesh)
    rules = meshkit.PartitionRules.fsdp("data") if args.rules == "fsdp" else None

    def to_float(record: data.Record) -> data.Record:
        image = record["image"]
        if image.dtype == np.uint8:
            image = image.astype(np.float32) / 255.0
        return {"image": image, "label": record["label"]}

    resident = args.input == "resident"
    to_device = train_source[0]["image"].dtype == np.uint8
    if resident and to_device:  # the same floats as to_float's, converted once
        train_source = data.ArraySource(
            to_float(train_source.getitems(np.arange(len(train_source)))),
            name=repr(train_source),
            num_classes=10,
        )
    with setup_errors_in_one_line():
        pipeline = data.TrainPipeline(
            train_source,
            global_batch_size=args.batch_size,
            sharding=batch_sharding,
            seed=args.seed,
            transform=(lambda r, rng: to_float(r)) if to_device and not resident else None,
            input_settings=data.InputSettings(resident=resident),
        )
    eval_pipeline = data.EvalPipeline(
        test_source,
        global_batch_size=args.batch_size,
        sharding=batch_sharding,
        transform=None if test_source[0]["image"].dtype != np.uint8 else to_float,
    )
    model = train.linen_model(MODELS[args.model](), jnp.zeros((1, *train_source[0]["image"].shape)))
    schedule = learning_rate_schedule(args)
    tx = optax.sgd(schedule, momentum=args.momentum)
    state = train.create_train_state(
        model, tx, mesh, rules=rules, seed=args.seed, precision=args.precision
    )
    step = train.make_train_step(
        train.classification_loss,
        train.state_shardings_of(state),
        batch_sharding,
        microbatches=args.microbatches,
        reduction=args.reduction,
    )
    if jax.process_index() == 0:
        print(meshkit.describe(state.params), flush=True)

    with run_errors_in_one_line():
        result = train.fit(
            state,
            step,
            pipeline,
            num_steps=args.steps,
            workdir=args.workdir,
            evaluation=train.Evaluation(eval_pipeline, every=args.eval_every),
            checkpoints=train.Checkpoints(every=args.checkpoint_every),
            **fit_options(args, schedule),
        )
    summary = {
        "model": args.model,
        "dataset": args.dataset,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "hyperparameters": hyperparameters(args, "rules", "reduction"),
        **run_summary(result),
        "test_accuracy": result.eval_metrics.get("accuracy"),
        "test_loss": result.eval_metrics.get("loss"),
        "test_examples": result.eval_metrics.get("count"),
    }
    write_summary(args.workdir, summary)
    return train.PREEMPTED_EXIT_CODE if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
