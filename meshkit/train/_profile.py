"""A ``jax.profiler`` trace of chosen training steps."""

from __future__ import annotations

import warnings
from typing import Any

import jax
from etils import epath


class StepProfiler:
    """Traces steps ``first .. first + count - 1`` into ``directory/process_<i>``.

    The trace starts before step ``first`` is queued and stops once step
    ``first + count - 1`` has finished on the devices, so it holds whole steps (each
    under a ``train`` step annotation, which TensorBoard's profile plugin and Perfetto
    show as steps). Each process writes its own folder. Steps outside the run (before a
    resume point, after ``num_steps``) are simply not traced.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: epath.Path):
        """``steps``: ``(first, count)``, checked by ``Dispatch``; ``None``: no trace."""
        self.first = self.last = 0
        if steps is not None:
            first, count = steps
            self.first, self.last = first, first + count - 1
        self.directory = directory / f"process_{jax.process_index()}"
        self.active = False

    def check_run(self, start: int, num_steps: int) -> None:
        """Warns, once, when the traced steps are not all among this run's ``start + 1 ..
        num_steps`` (a trace of none of them is never written)."""
        if not self.first or (start < self.first and self.last <= num_steps):
            return
        asked = f"profile_steps asks for steps {self.first}-{self.last}"
        run = f"this run trains steps {start + 1}-{num_steps}"
        if self.first > num_steps or self.last <= start:
            said = f"{asked}, but {run}: no profile will be written. Choose steps in that range."
        else:
            shown = f"{max(self.first, start + 1)}-{min(self.last, num_steps)}"
            said = f"{asked}, but {run}: only steps {shown} will be traced."
        warnings.warn(said, stacklevel=3)

    def before(self, step: int, last: int | None = None) -> None:
        """Starts the trace before the dispatch of steps ``step .. last`` (``last``:
        ``step``) that holds the first traced step is queued."""
        if self.first and step <= self.first <= (step if last is None else last):
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state: Any) -> None:
        """Stops the trace once the last traced step has finished."""
        if self.active and step >= self.last:
            self.stop(state)

    def stop(self, state: Any = None) -> None:
        """Waits for ``state`` and stops the trace, if one is running."""
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
