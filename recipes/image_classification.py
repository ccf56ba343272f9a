"""Image classification on encoded JPEG records: ResNet or ViT, augmented per example.

Command (no arguments: ResNet-18 with its small-image stem, at a quarter of its width,
on the embedded digits written as 32×32 RGB JPEG image records, on 8 fake CPU
devices)::

    python -m recipes.image_classification

Expected result, in about a minute on a 2-core machine: the layout report, a
progress bar, then a JSON summary (also in ``<workdir>/summary.json``) with a test
accuracy above 0.95 over all 360 test digits (0.978 measured), the images per second
this host trained on, the share of time the loop waited for input (under 5%) and how
the input reached the devices::

    {"model": "resnet18", "steps": 240, "test_accuracy": 0.97..., "images_per_second_per_host":
     667.9..., "input_wait_fraction": 0.004..., "input": "resident (replicated, 4.2 MiB per
     device), 1 step per dispatch (auto: 201 ms per step; a chunk of it would be written
     out step by step on a CPU, so none was timed)", ...}

Every training image is decoded from its JPEG bytes, randomly cropped and resized
(Inception-style), flipped (not for digits: a mirrored 2 is not a 2) and normalised.
Below 128 pixels a side the host only decodes (``--augment device``) and the train
step crops, flips and normalises the whole batch in its jit, where Python's per-image
work costs most. There the data is also resident by default (``--input resident``):
every training image is decoded once, the uint8 images are placed on the devices
(replicated, or split over the data axis when they do not fit) and each step gathers
its batch there, with new crops and flips every epoch; the test images are decoded,
centre-cropped and normalised once too. ``--input host`` decodes every batch on the
host (Grain workers ship uint8 batches), as larger images always are: they are
augmented on the host (``--augment host``), by threads. Threads or workers come from
``meshkit.data.image.input_settings``, by image size and cores (``--threads`` and
``--workers`` override it).

Other runs::

    python -m recipes.image_classification --model vit_tiny       # AdamW, 4×4 patches
    python -m recipes.image_classification --data-dir ~/flowers_records --image-size 64
    python -m recipes.image_classification --augment host --workers 1   # crops on the host
    python -m recipes.image_classification --input host       # decoded on the host each step
    python -m recipes.image_classification --mesh data=4,model=2 --rules fsdp --precision bf16

``--data-dir`` names a folder with ``train.array_record`` and ``test.array_record``
image records (and their ``.json`` sidecars), as ``python -m meshkit.data.convert
images --from-folder ROOT/train --out DIR/train.array_record`` (and the same for
``test``, adding ``--class-names-from DIR/train.array_record``) writes them from image
folders (``ROOT/train/<class name>/*.jpg``). Rerunning with the same ``--workdir``
resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import meshkit
from meshkit.data import image
from recipes._args import (
    add_input_options,
    add_training_options,
    fit_options,
    float_in,
    fraction,
    hyperparameters,
    int_at_least,
    learning_rate_schedule,
    make_mesh,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    recipe_parser,
    run_errors_in_one_line,
    run_summary,
    setup_errors_in_one_line,
    start_run,
    write_summary,
)

MODELS = ("resnet18", "resnet50", "vit_tiny", "vit_small")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(
        __doc__, workdir="workdir/image_classification", progress=True, resumes=True
    )
    parser.add_argument("--model", default="resnet18", choices=MODELS)
    parser.add_argument("--data-dir", type=Path, help="folder with train and test image records")
    parser.add_argument(
        "--image-size", type=int_at_least(8), default=32, help="training and test image side"
    )
    parser.add_argument(
        "--width",
        type=int,
        help="ResNet features in the first stage (default 16 on the "
        "embedded digits, else 64 as in the reference ResNets)",
    )
    parser.add_argument("--mesh", default="data=-1", help="mesh axes, e.g. data=4,model=2")
    parser.add_argument("--rules", choices=["replicated", "fsdp"], default="replicated")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="global batch size")
    parser.add_argument("--steps", type=positive_int, default=240)
    parser.add_argument(
        "--optimizer", choices=["sgd", "adamw"], help="default: sgd for ResNets, adamw for ViTs"
    )
    parser.add_argument(
        "--learning-rate", type=positive_float, help="default: 0.1 (sgd), 0.001 (adamw)"
    )
    parser.add_argument("--momentum", type=fraction, default=0.9, help="sgd's momentum")
    parser.add_argument(
        "--weight-decay",
        type=non_negative_float,
        help="default: 5e-4 (sgd), 0.05 (adamw, decoupled)",
    )
    parser.add_argument(
        "--min-crop",
        type=float_in(0.0, 1.0, low_open=True, high_open=False),
        default=0.35,
        help="smallest crop area share",
    )
    parser.add_argument(
        "--flip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random horizontal flips (default: on, except for the digits)",
    )
    parser.add_argument(
        "--augment",
        choices=["host", "device"],
        help="where training images are cropped, flipped and normalised (default: device "
        "below 128 pixels a side, else host)",
    )
    parser.add_argument(
        "--threads",
        type=non_negative_int,
        help="input threads per process (default: input_settings)",
    )
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        help="Grain worker processes per process (default: input_settings)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=positive_int, default=120)
    parser.add_argument("--checkpoint-every", type=positive_int, default=120)
    add_training_options(parser)
    add_input_options(
        parser,
        default_input=None,
        input_help="default: resident with --augment device, else host",
    )
    parser.set_defaults(lr_schedule="cosine", warmup_steps=None)
    args = parser.parse_args(argv)
    if args.warmup_steps is None:  # 20 steps, or a tenth of a shorter run
        args.warmup_steps = min(20, args.steps // 10)
    args.optimizer = args.optimizer or ("sgd" if args.model.startswith("resnet") else "adamw")
    args.learning_rate = args.learning_rate or (0.1 if args.optimizer == "sgd" else 1e-3)
    if args.weight_decay is None:
        args.weight_decay = 5e-4 if args.optimizer == "sgd" else 0.05
    if args.model.startswith("resnet"):
        args.width = args.width or (64 if args.data_dir else 16)
    small = args.image_size < image.DECODE_BOUND_SIDE
    args.augment = args.augment or ("device" if small else "host")
    args.input = args.input or ("resident" if args.augment == "device" else "host")
    if args.input == "resident" and args.augment == "host":
        parser.error(
            "--input resident decodes the training images once and augments them on the "
            "devices; --augment host augments every image on the host at every step. Pass "
            "--augment device, or --input host."
        )
    settings = image.input_settings(args.image_size)
    args.threads = settings.num_threads if args.threads is None else args.threads
    args.workers = settings.worker_count if args.workers is None else args.workers
    return args


def architecture_options(args: argparse.Namespace) -> dict[str, object]:
    """Below 128 pixels a side, ResNets keep their resolution in the stem (a 3×3 stride-1
    convolution, no pooling) and ViTs take 4×4 patches instead of 16×16. On the embedded
    digits a ResNet is a quarter as wide as the reference (16 features in its first
    stage instead of 64): it learns them as well and trains in minutes on a CPU."""
    small = args.image_size < 128
    if args.model.startswith("resnet"):
        return {"stem": "cifar" if small else "imagenet", "width": args.width}
    return {"patch_size": 4 if small else 16}


def optimizer(args: argparse.Namespace, schedule: Any) -> Any:
    """``--optimizer``: SGD with momentum and decoupled weight decay, or AdamW."""
    import optax

    if args.optimizer == "sgd":
        return optax.chain(
            optax.add_decayed_weights(args.weight_decay),
            optax.sgd(schedule, momentum=args.momentum),
        )
    return optax.adamw(schedule, weight_decay=args.weight_decay)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax
    import jax.numpy as jnp

    from meshkit import data, train
    from meshkit.models import MODELS as ARCHITECTURES

    scratch = tempfile.TemporaryDirectory(prefix="meshkit-digits-")  # removed at exit
    if args.data_dir is None:  # every process writes its own copy: a second or so
        records = data.write_digits_images(scratch.name, size=args.image_size)
    else:
        records = {split: args.data_dir / f"{split}.array_record" for split in ("train", "test")}
        if missing := [path.name for path in records.values() if not path.is_file()]:
            raise SystemExit(
                f"--data-dir {args.data_dir} holds no {' and no '.join(missing)}. Write them "
                "from image folders with python -m meshkit.data.convert images --from-folder "
                f"ROOT/train --out {args.data_dir}/train.array_record (and the same for test, "
                f"adding --class-names-from {args.data_dir}/train.array_record)."
            )
    with setup_errors_in_one_line():  # records without their sidecar, say
        train_source = data.image_records(records["train"])
        test_source = data.image_records(records["test"])
    if train_source.class_names != test_source.class_names:
        raise SystemExit(
            f"The train and test records name different classes ({train_source.class_names} "
            f"vs {test_source.class_names}): a label would mean one class in training and "
            "another in the test. Convert the test folder with --class-names-from TRAIN_RECORDS."
        )
    flip = args.flip if args.flip is not None else args.data_dir is not None

    mesh = make_mesh(args.mesh)
    start_run(args, mesh)  # a changed rerun stops here; a finished one ends here
    batch_sharding = meshkit.batch_sharding(mesh)
    mean, std = image.IMAGENET_MEAN, image.IMAGENET_STD
    augmentation = {"scale": (args.min_crop, 1.0), "flip": 0.5 if flip else 0.0}
    resident = args.input == "resident"  # decoded once, then crops and flips on the devices
    if args.augment == "device":  # the host decodes; the step crops, flips and normalises
        transform = image.decode_transform(args.image_size)
        on_device = image.device_augmentation(args.image_size, mean=mean, std=std, **augmentation)
        loss = on_device.wrap(train.classification_loss)
    else:
        transform = image.train_transform(args.image_size, mean=mean, std=std, **augmentation)
        loss = train.classification_loss
    with setup_errors_in_one_line():
        pipeline = data.TrainPipeline(
            train_source,
            global_batch_size=args.batch_size,
            sharding=batch_sharding,
            seed=args.seed,
            transform=transform,
            input_settings=data.InputSettings(
                num_threads=args.threads,
                worker_count=0 if resident else args.workers,
                resident=resident,
            ),
        )
        eval_pipeline = data.EvalPipeline(
            test_source,
            global_batch_size=args.batch_size,
            sharding=batch_sharding,
            transform=image.eval_transform(args.image_size, crop_fraction=1.0, mean=mean, std=std),
            input_settings=data.InputSettings(num_threads=args.threads, resident=resident),
        )
    module = ARCHITECTURES[args.model](
        num_classes=train_source.num_classes, **architecture_options(args)
    )
    model = train.linen_model(module, jnp.zeros((1, args.image_size, args.image_size, 3)))
    schedule = learning_rate_schedule(args)
    tx = optimizer(args, schedule)
    rules = meshkit.PartitionRules.fsdp("data") if args.rules == "fsdp" else None
    state = train.create_train_state(
        model, tx, mesh, rules=rules, seed=args.seed, precision=args.precision
    )
    step = train.make_train_step(
        loss,
        train.state_shardings_of(state),
        batch_sharding,
        microbatches=args.microbatches,
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
    local_batch = pipeline.shard.size
    summary = {
        "model": args.model,
        "data": str(args.data_dir or f"digits as {args.image_size}x{args.image_size} JPEG"),
        "image_size": args.image_size,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "hyperparameters": hyperparameters(
            args, "optimizer", "weight_decay", "min_crop", "width", "rules", "augment"
        ),
        **run_summary(result),
        "test_accuracy": result.eval_metrics.get("accuracy"),
        "test_loss": result.eval_metrics.get("loss"),
        "test_examples": result.eval_metrics.get("count"),
        "images_per_second_per_host": result.steps_per_second * local_batch,
    }
    write_summary(args.workdir, summary)
    return train.PREEMPTED_EXIT_CODE if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
