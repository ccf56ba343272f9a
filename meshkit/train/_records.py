"""``fit``'s host-side records: interval checks, progress, throughput, and the writers."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from tqdm import tqdm

from meshkit.checkpoint._checkpointer import Checkpointer
from meshkit.train._interval import WATCHED, IntervalRead
from meshkit.train._writers import MetricWriter

LearningRate = Callable[[int], Any] | float
"""An optax schedule (``count -> rate``) or a constant rate."""


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm stopped being finite; the run was stopped."""


MAX_SKIPPED_STEPS = 100
"""Consecutive float16 steps skipped for overflowing gradients after which ``fit``
stops: a loss scale that halved every time and still overflows (down to 1) means the
gradients overflow at any scale, and the parameters would never change again."""


class Records:
    """Checks each interval read, updates the progress bar, and writes the records.

    Every process checks and keeps the means (the hooks see them); process 0 writes.
    A training record holds the interval's metric means, plus ``learning_rate`` (the
    rate of its last step, when ``fit`` knows the schedule), ``steps_per_second`` (steps
    over the host time since the previous record, evaluation and checkpoint time left
    out; absent from a run's first record, which includes compilation) and
    ``input_wait`` (the share of that time spent waiting for input batches).
    """

    def __init__(
        self,
        writers: Sequence[MetricWriter],
        bar: tqdm,
        checkpointer: Checkpointer,
        learning_rate: LearningRate | None,
    ):
        self.writers = list(writers) if jax.process_index() == 0 else []
        self.bar = bar
        self.checkpointer = checkpointer
        self.learning_rate = learning_rate
        self.last: dict[str, Any] = {}
        self._since: tuple[int, float, float, float] | None = None  # step, time, paused, wait
        self._skipped_since: int | None = None  # first step of the current run of skips

    def start(self, step: int) -> None:
        """The run starts after ``step``: writers drop what an earlier run recorded later."""
        for writer in self.writers:
            writer.start(step)

    def interval(
        self,
        read: IntervalRead,
        *,
        paused: float,
        input_wait: float,
        diagnose: Callable[[int], str | None] | None = None,
    ) -> dict[str, Any]:
        """Checks an interval for non-finite steps, then records and returns its values.

        ``paused`` and ``input_wait`` are this run's evaluation and checkpoint seconds
        and input-wait seconds so far. ``diagnose(step)``, called only when a step was
        not finite, may name its cause (a sentence) in place of the general advice.
        """
        if read.first_bad_step is not None:
            cause = diagnose(read.first_bad_step) if diagnose is not None else None
            raise self._non_finite(read, cause)
        self._check_skipped(read)
        values = dict(read.means)
        if self.learning_rate is not None:
            values["learning_rate"] = _rate_at(self.learning_rate, read.last)
        now = time.perf_counter()
        if self._since is not None:
            step, then, paused_then, wait_then = self._since
            seconds = now - then - (paused - paused_then)
            if seconds > 0 and read.last > step:
                values["steps_per_second"] = (read.last - step) / seconds
                values["input_wait"] = min(max((input_wait - wait_then) / seconds, 0.0), 1.0)
        self._since = (read.last, now, paused, input_wait)
        self.last = read.means
        self.bar.update(read.last - self.bar.n)
        postfix = _bar_losses(read.means)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.write(read.last, values)
        return values

    def _non_finite(self, read: IntervalRead, cause: str | None) -> NonFiniteLossError:
        latest = self.checkpointer.latest_step()
        kept = (
            f"The newest checkpoint, step {latest} in {self.checkpointer.directory}, "
            "was saved before it and is kept (verified against its digest when a run "
            "resumes from it)"
            if latest is not None
            else "No checkpoint was saved before it"
        )
        watched = {name: read.means[name] for name in WATCHED if name in read.means}
        advice = cause or (
            "Lower the learning rate, check the data for NaNs, check that labels lie in "
            "[0, classes) and token ids in [0, vocabulary) (meshkit's losses and "
            "Transformer give NaN for any other), or add gradient clipping."
        )
        return NonFiniteLossError(
            f"Training stopped at step {read.first_bad_step}: the loss or gradient norm "
            f"was not finite (means over steps {read.first}-{read.last}: {watched}). "
            f"{kept}; no state from step {read.first_bad_step} on was saved. {advice}"
        )

    def _check_skipped(self, read: IntervalRead) -> None:
        """Counts the float16 steps skipped in a row, over whole intervals: an interval
        whose every step was skipped extends the run, any other ends it."""
        if "skipped" not in read.means:
            return
        if read.means["skipped"] < 1.0:
            self._skipped_since = None
            return
        if self._skipped_since is None:
            self._skipped_since = read.first
        skipped = read.last - self._skipped_since + 1
        if skipped < MAX_SKIPPED_STEPS:
            return
        latest = self.checkpointer.latest_step()
        kept = (
            f"The newest checkpoint is step {latest} in {self.checkpointer.directory}"
            if latest is not None
            else "No checkpoint was saved"
        )
        raise NonFiniteLossError(
            f"Training stopped at step {read.last}: the last {skipped} steps (from step "
            f"{self._skipped_since}) were all skipped because their float16 gradients "
            "overflowed (mean loss scale over the last record: "
            f"{read.means.get('loss_scale', float('nan')):g}), so the parameters have not "
            f"changed since step {self._skipped_since - 1}. {kept}. The gradients are not "
            "finite at any scale: check the loss and the data for infinities, a division "
            "or square root at zero, or train in bf16 or f32 "
            "(create_train_state(..., precision='bf16'))."
        )

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.write(step, values)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def _rate_at(learning_rate: LearningRate, step: int) -> float:
    """The rate of step ``step`` (1-based): an optax schedule's value at count ``step - 1``."""
    if callable(learning_rate):
        return float(learning_rate(step - 1))
    return float(learning_rate)


_MEMBER_LOSS = re.compile(r"^member_\d+/loss$")


def _bar_losses(means: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows: ``loss``, or for several members (an ensemble, a
    sweep) the median and the best member's loss, so one diverged member does not hide
    how the others do.

    Examples:
        >>> _bar_losses({"loss": 0.5})
        {'loss': '0.5000'}
        >>> _bar_losses({"loss": 9.0, "member_0/loss": 0.2, "member_1/loss": float("nan"),
        ...              "member_2/loss": 0.4})
        {'median loss': '0.3000', 'best': '0.2000', 'diverged': '1'}
    """
    members = [float(v) for k, v in means.items() if _MEMBER_LOSS.match(k)]
    if not members:
        return {"loss": f"{means['loss']:.4f}"} if "loss" in means else {}
    finite = sorted(v for v in members if math.isfinite(v))
    shown = {}
    if finite:
        shown["median loss"] = f"{statistics.median(finite):.4f}"
        shown["best"] = f"{finite[0]:.4f}"
    if len(finite) < len(members):
        shown["diverged"] = str(len(members) - len(finite))
    return shown
