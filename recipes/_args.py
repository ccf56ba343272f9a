"""The command-line options every recipe shares, defined once."""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

from etils import epath


def workdir_path(value: str) -> epath.Path:
    """``--workdir``: an object-store URI as it is (``gs://...``), a local path made absolute."""
    path = epath.Path(value)
    return path if "://" in value else path.absolute()


class HelpWithDefaults(argparse.HelpFormatter):
    """``--help`` that gives every option's default: after its help, or alone where it
    has none (not for a flag that is off, nor where the help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, shown = action.help or "", _shown_default(action)
        return text if not shown or "default" in text else f"{text} ({shown})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and (shown := _shown_default(action)):
            action = copy.copy(action)
            action.help = f"({shown})"
        return super()._format_action(action)


def _shown_default(action: argparse.Action) -> str:
    """``default: 128``, or ``""``; a default of 0 is shown (``0 == False`` in Python)."""
    if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
        return ""
    default = action.default
    shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
    return f"default: {shown.replace('%', '%%')}"


def recipe_parser(
    doc: str | None,
    *,
    workdir: str | None = None,
    progress: bool = False,
    resumes: bool = False,
    cpu_devices: bool = True,
) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with the shared options.

    Every recipe that runs on this machine's devices (``cpu_devices``) gets
    ``--cpu-devices`` (fake CPU devices per process, from ``JAX_NUM_CPU_DEVICES`` or 8);
    with ``workdir``, ``--workdir`` defaulting to it;
    with ``resumes`` (a training recipe, which resumes the run in its workdir),
    ``--fresh`` (see ``start_run``); with ``progress``, ``--no-progress`` to turn the
    progress bar off.
    """
    parser = argparse.ArgumentParser(
        description=(doc or "").splitlines()[0], formatter_class=HelpWithDefaults
    )
    if workdir is not None:
        parser.add_argument(
            "--workdir",
            type=workdir_path,
            default=workdir_path(workdir),
            help="a local folder or an object-store URI such as gs://bucket/run",
        )
    if workdir is not None and resumes:
        parser.add_argument(
            "--fresh",
            action="store_true",
            help="start over: delete the checkpoints, records and config of the run in "
            "--workdir first (without it, a rerun resumes that run)",
        )
    if cpu_devices:
        parser.add_argument(
            "--cpu-devices",
            type=int,
            default=int(os.environ.get("JAX_NUM_CPU_DEVICES", "8")),
            help="fake CPU devices per process (only used on the CPU backend)",
        )
    if progress:
        parser.add_argument("--no-progress", action="store_true")
    return parser


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Adds the options of a training recipe: precision, schedule, micro-batches, records.

    ``--precision`` (``f32``, ``bf16``, ``f16`` with dynamic loss scaling),
    ``--lr-schedule`` (``constant`` or ``cosine``, decaying to 0 at the last step),
    ``--warmup-steps`` (a linear ramp from 0), ``--tensorboard``,
    ``--profile-steps FIRST,COUNT`` and ``--microbatches``.
    """
    parser.add_argument(
        "--precision",
        choices=["f32", "bf16", "f16"],
        default="f32",
        help="compute dtype; parameters and optimizer state stay float32",
    )
    parser.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    parser.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=0,
        help="steps of linear learning-rate warm-up",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write the records to a TensorBoard event file in <workdir>/tensorboard",
    )
    parser.add_argument(
        "--profile-steps",
        type=_step_range,
        metavar="FIRST,COUNT",
        help="a jax.profiler trace of COUNT steps from step FIRST in <workdir>/profile",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=1,
        help="accumulate gradients over this many micro-batches of each batch",
    )


def add_input_options(
    parser: argparse.ArgumentParser,
    *,
    steps_per_dispatch: int | str = "auto",
    default_input: str | None = "resident",
    input_help: str = "",
) -> None:
    """Adds ``--input`` (``resident``: the dataset on the devices, batches gathered there;
    ``host``: each batch copied from the host; default ``default_input``, ``None`` for a
    recipe that decides after parsing, saying how in ``input_help``) and
    ``--steps-per-dispatch`` (a number, or ``auto``: calibrated at the start of the run;
    default ``steps_per_dispatch``)."""
    parser.add_argument(
        "--input",
        choices=["resident", "host"],
        default=default_input,
        help="resident: the training set on the devices, each batch gathered there by "
        "index (the same batches as host); host: each batch copied from the host"
        + (f" ({input_help})" if input_help else ""),
    )
    parser.add_argument(
        "--steps-per-dispatch",
        type=_steps_per_dispatch,
        default=steps_per_dispatch,
        metavar="N|auto",
        help="training steps each call of the step program runs; auto: 1, or a probed "
        "chunk where it measured faster at the start of the run",
    )


@contextlib.contextmanager
def setup_errors_in_one_line() -> Iterator[None]:
    """A ``ValueError`` while the training input or the run is set up (a dataset too
    large to be resident, a batch larger than the dataset, a workdir holding a run with
    other settings), a ``FileNotFoundError`` (a ``--data-dir`` without the dataset's
    files: its message names them), or an object-store workdir without its client
    package (gcsfs, s3fs) or its network, ends the recipe with its message alone: each
    names the setting and the fix; a traceback would only bury it."""
    try:
        yield
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        raise SystemExit(str(error)) from None
    except ImportError as error:  # an object-store workdir without its client package
        if error.name not in ("gcsfs", "s3fs"):
            raise
        raise SystemExit(str(error)) from None


@contextlib.contextmanager
def run_errors_in_one_line() -> Iterator[None]:
    """Around a recipe's training: what ends a run for a reason outside the program
    (a full disk, a failed save, a non-finite loss, a settings error) ends the recipe
    with its message alone, which names the cause, what was kept and the fix."""
    from meshkit import checkpoint, train

    try:
        with setup_errors_in_one_line():
            yield
    except (checkpoint.CheckpointSaveError, train.NonFiniteLossError) as error:
        raise SystemExit(str(error)) from None
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise SystemExit(str(error)) from None


def make_mesh(text: str) -> Any:
    """``--mesh``: ``meshkit.make_mesh(text)``, or the recipe ends with what is wrong
    with the axes (sizes that do not multiply to the devices, an unknown form) in one
    line that names the flag."""
    import meshkit

    try:
        return meshkit.make_mesh(text)
    except ValueError as error:
        raise SystemExit(f"--mesh {text}: {error}") from None


RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "summary.json")
"""What a training recipe writes in its workdir, and ``--fresh`` deletes."""


def start_run(
    args: argparse.Namespace,
    mesh: Any,
    *,
    resuming: bool | None = None,
    finished: bool = True,
    run_files: tuple[str, ...] = RUN_FILES,
) -> None:
    """The start of a training recipe, before anything is built or compiled.

    The recipe claims its workdir (``train.claim_workdir``) until its process ends:
    a workdir another run holds, or one holding files under ``run_files`` that
    meshkit did not write, stops it in one line. ``--fresh`` then deletes what a
    meshkit run wrote there. Then ``config.json`` records the run's arguments: a run
    already in the workdir (``resuming``: see ``write_run_config``) with other
    settings stops the recipe in one line naming each difference, and (``finished``)
    one whose checkpoints already reached ``--steps`` ends it in one line saying so,
    instead of loading it to train no step.
    """
    import jax

    from meshkit import train

    profile = getattr(args, "profile_steps", None)
    if profile and profile[0] > args.steps:
        first, count = profile
        raise SystemExit(
            f"--profile-steps {first},{count} traces steps {first}-{first + count - 1}, but "
            f"--steps {args.steps} ends the run before them: choose a first step of at most "
            f"{args.steps}."
        )
    with setup_errors_in_one_line():
        train.claim_workdir(args.workdir, writes=run_files, fresh=args.fresh)
        train.parts.write_run_config(args.workdir, args, mesh, resuming=resuming)
    done = None
    if finished:
        checkpointer = train.Checkpoints().checkpointer(args.workdir)
        done = checkpointer.latest_step()
        checkpointer.close()
    if done is not None and done >= args.steps:
        if jax.process_index() == 0:
            print(
                f"{args.workdir} already holds this run, done at step {done} (its summary: "
                f"{args.workdir / 'summary.json'}); pass a larger --steps to train on, or "
                "--fresh to start over.",
                flush=True,
            )
        raise SystemExit(0)


def _steps_per_dispatch(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least 1 or auto, got {text!r}"
        ) from None


def hyperparameters(args: argparse.Namespace, *recipe_specific: str) -> dict[str, Any]:
    """The settings that decide what is learned, for ``summary.json``: the training
    options every recipe shares, the seed, and the ``recipe_specific`` names."""
    names = ("learning_rate", "lr_schedule", "warmup_steps", "momentum", "batch_size")
    names += ("microbatches", "precision", "seed", *recipe_specific)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def learning_rate_schedule(args: argparse.Namespace) -> Any:
    """The ``optax`` schedule of ``--learning-rate``, ``--lr-schedule`` and ``--warmup-steps``.

    A constant rate without warm-up stays a float, so the optimizer state (and the
    checkpoints of runs made before these options) keeps its structure.
    """
    import optax

    if not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(
            f"--warmup-steps {args.warmup_steps} must be at least 0 and below --steps {args.steps}."
        )
    if args.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, args.learning_rate, args.warmup_steps, args.steps, end_value=0.0
        )
    if not args.warmup_steps:
        return args.learning_rate  # a float: the optimizer state of earlier runs, unchanged
    constant = optax.constant_schedule(args.learning_rate)
    warmup = optax.linear_schedule(0.0, args.learning_rate, args.warmup_steps)
    return optax.join_schedules([warmup, constant], [args.warmup_steps])


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low``; argparse's error names the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
"""An argparse type: a whole number of at least 1 (``--steps``, ``--batch-size``)."""
non_negative_int = int_at_least(0)
"""An argparse type: a whole number of at least 0 (``--workers``, ``--warmup-steps``)."""


def float_in(
    low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = True
) -> Callable[[str], float]:
    """An argparse type: a number from ``low`` to ``high``, each end in or out of range."""
    shown = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if high == math.inf:
        shown = f"above {low:g}" if low_open else f"at least {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = low < value if low_open else low <= value
        below = value < high if high_open else value <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be {shown}, got {text}")
        return value

    return parse


positive_float = float_in(0.0, low_open=True)
"""An argparse type: a number above 0 (``--learning-rate``, ``--tol``)."""
non_negative_float = float_in(0.0)
"""An argparse type: a number of at least 0 (``--weight-decay``)."""
fraction = float_in(0.0, 1.0)
"""An argparse type: a number in [0, 1) (``--momentum``, ``--dropout-rate``)."""


def _step_range(text: str) -> tuple[int, int]:
    """``"10,5"`` as ``(10, 5)``: the first step and the step count."""
    try:
        first, count = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected FIRST,COUNT (two integers, e.g. 10,5), got {text!r}"
        ) from None
    return first, count


def fit_options(args: argparse.Namespace, schedule: Any) -> dict[str, Any]:
    """``fit``'s ``logging`` and ``dispatch`` from the training options: progress bar,
    writers, schedule, profile."""
    from meshkit import train

    writers = [train.TensorBoardWriter(args.workdir / "tensorboard")] if args.tensorboard else []
    return {
        "logging": train.Logging(
            progress=not args.no_progress, writers=writers, learning_rate=schedule
        ),
        "dispatch": train.Dispatch(
            profile_steps=args.profile_steps,
            steps_per_dispatch=getattr(args, "steps_per_dispatch", 1),
        ),
    }


def run_summary(result: Any) -> dict[str, Any]:
    """The summary keys every training recipe reports from ``fit``'s result: steps,
    resume, the last training loss, the step rate, input wait and compiles."""
    return {
        "steps": result.step,
        "resumed_from": result.resumed_from,
        "preempted": result.preempted,
        "final_train_loss": result.train_metrics.get("loss"),
        "steps_per_second": result.steps_per_second,
        "input_wait_fraction": result.input_wait_fraction,
        "input_startup_seconds": result.input_startup_seconds,
        "train_step_compiles": result.train_step_compiles,
        "input": f"{result.input_path}, {result.dispatch}",
    }


def write_summary(workdir: Any, summary: dict[str, Any]) -> None:
    """The end of a training recipe: on process 0, ``summary.json`` in ``workdir``,
    a line saying where the run's files are, and the summary as the last line printed.
    (The workdir is let go when the recipe's process ends.)"""
    import jax

    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"The run's checkpoints, records and summary are in {workdir}", flush=True)
        print(json.dumps(summary), flush=True)
