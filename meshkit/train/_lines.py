"""Log lines from each step's metrics, summed on the host.

``fit``'s step program returns every step's metrics as one row of a small float32
table (``MetricLayout.pack``); the host copies each dispatch's table one dispatch late
(so the copy never stalls the devices) and ``LogLines`` sums the rows into a line every
``every`` steps, with the first step whose watched metrics were not finite. A line is
the same whatever the steps per dispatch: its rows are summed in float32 in step order
once it closes, the sums ``MetricSums`` keeps on the device for a loop of one's own.
"""

from __future__ import annotations

import numpy as np

from meshkit.train._interval import IntervalRead, MetricLayout, host_interval_read


class LogLines:
    """The open log line's rows, and the lines they close.

    Examples:
        >>> layout = MetricLayout(("loss",), ((),), ("loss",))
        >>> lines = LogLines(layout, every=2)
        >>> lines.add(np.asarray([[1.0], [2.0], [4.0]], np.float32), first=1)
        [IntervalRead(first=1, last=2, means={'loss': 1.5}, first_bad_step=None)]
        >>> lines.pending, lines.flush(last=3)
        (1, IntervalRead(first=3, last=3, means={'loss': 4.0}, first_bad_step=None))
        >>> lines.add(np.asarray([[np.nan]], np.float32), first=4)[0].first_bad_step
        4
    """

    def __init__(self, layout: MetricLayout, every: int):
        self.layout = layout
        self.every = every
        self._rows: list[np.ndarray] = []  # the open line's rows, in step order
        self.pending = 0
        """Steps in the open line."""
        self._watched = np.concatenate([layout.columns(name) for name in layout.watched])

    def add(self, rows: np.ndarray, first: int) -> list[IntervalRead]:
        """Adds ``rows`` (row ``k`` is step ``first + k``'s metrics); returns the lines
        that closed (at every step that is a multiple of ``every``)."""
        closed = []
        done, count = 0, len(rows)
        while done < count:
            step = first + done
            close = (step - 1) // self.every * self.every + self.every  # the line's last step
            take = min(count - done, close - step + 1)
            self._rows.append(rows[done : done + take])
            self.pending += take
            done += take
            if step + take - 1 == close:
                closed.append(self.flush(close))
        return closed

    def flush(self, last: int) -> IntervalRead:
        """The open line, ended at step ``last`` (a boundary between log steps)."""
        assert self.pending, "no steps in the open log line"
        rows = np.concatenate(self._rows)
        self._rows, self.pending = [], 0
        finite = np.isfinite(rows[:, self._watched]).all(axis=1)
        first_bad = 0 if finite.all() else int(np.argmin(finite)) + 1  # 1-based, as Interval's
        sums = np.add.accumulate(rows, axis=0)[-1]  # float32, in step order: as MetricSums
        return host_interval_read(self.layout, sums, len(rows), first_bad, last)
