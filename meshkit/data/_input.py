"""``InputSettings``: how a pipeline builds and delivers its batches, in one object.

Every pipeline (``TrainPipeline``, ``EvalPipeline``, ``MemberTrainPipeline``) takes
``input_settings=InputSettings(...)``. The settings change how fast batches arrive,
never which examples they hold or in what order: a run's batches are the same with any
of them. ``meshkit.data.image.input_settings(side)`` returns the measured choice for
image records.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from meshkit._checks import check_int
from meshkit.data._resident import ResidentMode


@dataclasses.dataclass(frozen=True)
class InputSettings:
    """How a pipeline builds its batches and where it keeps the data.

    Attributes:
      num_threads: threads that read and transform examples ahead of time. ``None``:
        0 for in-memory arrays without a transform (a batch is one numpy gather), 2
        otherwise; 0 builds batches in the training loop's thread.
      worker_count: Grain worker processes that build whole batches (the script needs
        an ``if __name__ == "__main__":`` guard; they take a second or two to start).
      prefetch: batches (for threads) or batches per worker built ahead of time.
      resident: ``True`` places the whole dataset on the devices once and gathers each
        batch there by index (the same examples in the same order as host input):
        replicated when it fits within a quarter of one device's memory, else its rows
        split over the data axes. ``"replicated"`` or ``"sharded"`` chooses the layout
        (``EvalPipeline`` takes ``True`` or ``False``). ``False`` builds batches on the
        host and copies each to the devices.
      placement: which thread copies host batches to the devices. ``'loop'``: the
        training loop's own, queued asynchronously a few batches ahead; ``'thread'``:
        a thread of its own that keeps the next batches placed, so their copies
        overlap the step under way while the loop only dispatches; ``'auto'``: a
        thread on GPUs and TPUs, the loop on a CPU, where a thread's hand-offs measured
        slower. Resident data needs no copies and ignores it.

    Examples:
        >>> InputSettings(resident=True)
        InputSettings(num_threads=None, worker_count=0, prefetch=4, resident=True, placement='auto')
        >>> InputSettings(num_threads=-1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: InputSettings(num_threads=...) must be an int >= 0, got -1. None lets ...
    """

    num_threads: int | None = None
    worker_count: int = 0
    prefetch: int = 4
    resident: bool | ResidentMode = False
    placement: Literal["auto", "loop", "thread"] = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.resident, np.bool_):  # a plain bool: it goes into summaries
            object.__setattr__(self, "resident", bool(self.resident))
        if self.num_threads is not None:
            check_int(
                self.num_threads,
                name="InputSettings(num_threads=...)",
                minimum=0,
                fix="None lets the pipeline choose (0 for in-memory arrays, 2 with a transform).",
            )
        check_int(self.worker_count, name="InputSettings(worker_count=...)", minimum=0)
        check_int(self.prefetch, name="InputSettings(prefetch=...)", minimum=0)
        if self.resident not in (True, False, "replicated", "sharded") or not isinstance(
            self.resident, bool | str
        ):
            raise ValueError(
                "InputSettings(resident=...) must be True, False, 'replicated' or 'sharded', "
                f"got {self.resident!r}."
            )
        if self.placement not in ("auto", "loop", "thread"):
            raise ValueError(
                "InputSettings(placement=...) must be 'auto', 'loop' or 'thread', got "
                f"{self.placement!r}. 'auto' places batches from a thread of their own on "
                "GPUs and TPUs and from the training loop on a CPU."
            )

    def describe(self) -> str:
        """``"resident"`` or how host batches are built, for a run's summary."""
        if self.resident is not False:
            return "resident" if self.resident is True else f"resident ({self.resident})"
        threads = "auto" if self.num_threads is None else self.num_threads
        placed = "" if self.placement == "auto" else f", placed by the {self.placement}"
        return f"host ({threads} threads, {self.worker_count} workers{placed})"


def checked_settings(pipeline: str, settings: InputSettings | None) -> InputSettings:
    """``settings``, or the defaults; anything else than an ``InputSettings`` is refused."""
    if settings is not None and not isinstance(settings, InputSettings):
        raise TypeError(
            f"{pipeline}(input_settings=...) must be a meshkit.data.InputSettings, got "
            f"{settings!r}. Build one with InputSettings(num_threads=..., resident=...)."
        )
    return settings or InputSettings()
