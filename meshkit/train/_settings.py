"""``fit``'s settings: small frozen objects, one per concern, checked when they are made.

``Evaluation`` (what to evaluate and when), ``Checkpoints`` (when and where to save:
the checkpoint policy), ``Logging`` (records, progress bar, writers) and ``Dispatch``
(how many steps are queued, which are profiled). Each one is also usable on its own
by a loop of your own: ``Evaluation.due``/``run``, ``Checkpoints.due``/``checkpointer``,
``Dispatch.window``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from jax.sharding import Mesh

from meshkit._checks import check_int
from meshkit._inflight import InFlight
from meshkit._paths import PathLike, as_path
from meshkit._types import PerExampleFn
from meshkit.checkpoint._checkpointer import Checkpointer
from meshkit.data import EvalPipeline
from meshkit.evaluate import full_eval
from meshkit.train._records import LearningRate
from meshkit.train._step import classification_metrics
from meshkit.train._writers import MetricWriter


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Full evaluation during ``fit``: on which data, how often, with which metrics.

    Attributes:
      pipeline: the evaluation data (a ``meshkit.data.EvalPipeline``).
      every: evaluation period in steps; ``None`` evaluates after the last step only
        (a period evaluates after the last step too).
      per_example_fn: ``fn(state, batch) -> {name: per-example values}``; the means
        over every example are reported. ``None``: ``classification_metrics`` in
        ``fit``, ``ensemble_metrics(layout)`` in ``run_sweep``.

    Examples:
        >>> import meshkit
        >>> from meshkit import data
        >>> mesh = meshkit.make_mesh("data=-1")
        >>> test = data.EvalPipeline(
        ...     data.digits("test"), global_batch_size=64, sharding=meshkit.batch_sharding(mesh)
        ... )
        >>> evaluation = Evaluation(test, every=50)
        >>> [evaluation.due(step, last=step == 120) for step in (49, 50, 51, 120)]
        [False, True, False, True]
        >>> Evaluation(test, every=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Evaluation(every=...) must be an int >= 1 step, got 0. Pass every=None ...
    """

    pipeline: EvalPipeline
    every: int | None = None
    per_example_fn: PerExampleFn | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline, EvalPipeline):
            raise TypeError(
                "Evaluation(pipeline) must be a meshkit.data.EvalPipeline (padded, masked "
                f"batches that count every example once), got {type(self.pipeline).__name__}. "
                "Build one with data.EvalPipeline(source, global_batch_size=..., sharding=...)."
            )
        if self.every is not None:
            check_int(
                self.every,
                name="Evaluation(every=...)",
                minimum=1,
                unit="step",
                fix="Pass every=None to evaluate after the last step only.",
            )
        if self.per_example_fn is not None and not callable(self.per_example_fn):
            raise TypeError(
                "Evaluation(per_example_fn=...) must be a function (state, batch) -> "
                f"{{name: per-example values}}, got {self.per_example_fn!r}."
            )

    def due(self, step: int, *, last: bool) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps, and after the last."""
        return last or bool(self.every and step % self.every == 0)

    def run(self, state: Any) -> dict[str, float]:
        """Evaluates ``state`` on every example once: ``count`` plus each metric's mean."""
        result = full_eval(self.per_example_fn or classification_metrics, state, self.pipeline)
        return {"count": result.count, **result.metrics}


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """The checkpoint policy: when to save, how many to keep, and where.

    A checkpoint is due every ``every`` steps, after the last step, and when the run
    stops early (a preemption or a hook): ``due`` says which, so a loop of your own
    saves at the same steps as ``fit``. ``checkpointer`` opens the ``Checkpointer``;
    call its ``check(step)`` at every step, so a save that failed in the background
    stops the run at once, and ``save(step, state, data_state, force=True)`` when due.

    Attributes:
      every: save period in steps.
      keep: how many of the newest checkpoints to keep.
      directory: where they go; ``None``: ``<workdir>/checkpoints``.

    Examples:
        >>> policy = Checkpoints(every=10)
        >>> [step for step in range(1, 26) if policy.due(step, last=step == 25)]
        [10, 20, 25]
        >>> policy.due(7, last=False, stopping=True)  # preempted: save before stopping
        True
        >>> Checkpoints(keep=0)
        Traceback (most recent call last):
        ...
        ValueError: Checkpoints(keep=...) must be an int >= 1 checkpoint, got 0.
    """

    every: int = 100
    keep: int = 3
    directory: PathLike | None = None

    def __post_init__(self) -> None:
        check_int(
            self.every,
            name="Checkpoints(every=...)",
            minimum=1,
            unit="step",
            fix="Pass every=num_steps to save after the last step only.",
        )
        check_int(self.keep, name="Checkpoints(keep=...)", minimum=1, unit="checkpoint")

    def due(self, step: int, *, last: bool, stopping: bool = False) -> bool:
        """Whether to save after ``step``: a multiple of ``every``, the last step, or a stop."""
        return last or stopping or step % self.every == 0

    def checkpointer(self, workdir: PathLike) -> Checkpointer:
        """A ``Checkpointer`` on ``directory``, or on ``workdir/checkpoints``."""
        directory = as_path(workdir) / "checkpoints" if self.directory is None else self.directory
        return Checkpointer(directory, save_every=self.every, keep=self.keep)


@dataclasses.dataclass(frozen=True)
class Logging:
    """``fit``'s records: how often, and where beside ``metrics.jsonl``.

    Attributes:
      every: steps per training record (each holds the means over the steps since the
        previous one) and per progress bar update.
      progress: show a progress bar (process 0 only).
      writers: more places for the records (process 0 writes):
        ``TensorBoardWriter``, ``WandbWriter`` or any ``MetricWriter``.
      learning_rate: the optimizer's schedule (or constant rate), recorded as
        ``learning_rate`` in each training record.

    Examples:
        >>> Logging(every=5, progress=False).writers
        ()
        >>> Logging(writers=["tb"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Logging(writers=...) must hold MetricWriters (start, write and close), got ...
    """

    every: int = 10
    progress: bool = True
    writers: Sequence[MetricWriter] = ()
    learning_rate: LearningRate | None = None

    def __post_init__(self) -> None:
        check_int(self.every, name="Logging(every=...)", minimum=1, unit="step")
        if not isinstance(self.progress, bool):
            raise TypeError(f"Logging(progress=...) must be True or False, got {self.progress!r}.")
        if isinstance(self.writers, MetricWriter) or not isinstance(self.writers, Sequence):
            raise TypeError(
                "Logging(writers=...) must be a list of MetricWriters, got "
                f"{type(self.writers).__name__}. Pass writers=[writer]."
            )
        for writer in self.writers:
            if not isinstance(writer, MetricWriter):
                raise TypeError(
                    "Logging(writers=...) must hold MetricWriters (start, write and close), "
                    f"got {writer!r} ({type(writer).__name__}). Pass e.g. "
                    "writers=[TensorBoardWriter(logdir)]."
                )
        object.__setattr__(self, "writers", tuple(self.writers))
        rate = self.learning_rate
        if not (rate is None or callable(rate) or isinstance(rate, int | float)):
            raise TypeError(
                "Logging(learning_rate=...) must be an optax schedule (step -> rate) or a "
                f"number, got {rate!r} ({type(rate).__name__})."
            )


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How ``fit`` hands steps to the devices: how many are queued, which are profiled.

    Attributes:
      max_in_flight: the most steps queued on the devices at once; ``None``:
        ``default_max_in_flight(mesh)`` (1 on a mesh of several CPU devices, else 3).
        The results are the same for any depth.
      profile_steps: ``(first_step, count)``: a ``jax.profiler`` trace of those steps
        in ``workdir/profile/process_<i>``; ``None``: no trace.
      stall_timeout: seconds the loop may wait for one input batch or for the devices
        before the run counts as stalled and ends with code 1, naming the step and the
        wait (and, with several processes, stopping every process); ``None``:
        ``MESHKIT_STALL_TIMEOUT``, else 1800. The first step (compiling), evaluations
        and checkpoint saves are not timed.
      steps_per_dispatch: steps each call of the step program runs (a loop over the
        train step; batches stacked, or gathered on the devices from resident data),
        so a small model is not held back by the host. An int ``N >= 1``, or
        ``'auto'``: a calibration on the run's first steps that times one-step
        dispatches and a probe chunk, and keeps the chunk where its steps ran in at
        most 0.9 of the time (``FitResult`` says what it measured and chose; the
        rule is in docs/training.md). Dispatches end at every checkpoint and
        evaluation; a preemption, a failed save or a hook's stop is answered after
        the dispatch under way. Where fewer than ``N`` steps are left before a
        boundary they run one per dispatch. Log lines and results are the same for
        every ``N``. 1 (the default) dispatches every step.

    Examples:
        >>> import jax, meshkit
        >>> one = meshkit.make_mesh("data=1", devices=jax.devices()[:1])
        >>> Dispatch().window(one).limit, Dispatch(max_in_flight=1).window(one).limit
        (3, 1)
        >>> Dispatch(profile_steps=(10, 0))
        Traceback (most recent call last):
        ...
        ValueError: profile_steps[1] (the step count) must be an int >= 1, got 0.
    """

    max_in_flight: int | None = None
    profile_steps: tuple[int, int] | None = None
    stall_timeout: float | None = None
    steps_per_dispatch: int | Literal["auto"] = 1

    def __post_init__(self) -> None:
        if self.steps_per_dispatch != "auto":
            check_int(
                self.steps_per_dispatch,
                name="Dispatch(steps_per_dispatch=...)",
                minimum=1,
                unit="step",
                fix="Pass a whole number of steps, or 'auto' to measure at the start of the run.",
            )
        if self.max_in_flight is not None:
            check_int(self.max_in_flight, name="max_in_flight", minimum=1, unit="step")
        timeout = self.stall_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(f"stall_timeout must be a number of seconds > 0, got {timeout!r}.")
        steps = self.profile_steps
        if steps is None:
            return
        if not isinstance(steps, tuple | list) or len(steps) != 2:
            raise ValueError(
                f"profile_steps must be (first_step, count), e.g. (10, 5), got {steps!r}."
            )
        check_int(steps[0], name="profile_steps[0] (the first step)", minimum=1)
        check_int(steps[1], name="profile_steps[1] (the step count)", minimum=1)
        object.__setattr__(self, "profile_steps", tuple(steps))

    def window(self, mesh: Mesh) -> InFlight[Any]:
        """An empty window of ``max_in_flight`` steps (or the default for ``mesh``)."""
        if self.max_in_flight is None:
            return InFlight.for_mesh(mesh)
        return InFlight(self.max_in_flight)
