"""Host batches placed on the devices by a thread of their own, ahead of the training loop.

On a GPU or TPU a step of a small model takes less time than the host needs to build
its batch and copy it across: when the training loop's own thread does both, the
device waits. ``PlacedAhead`` moves the reading and the placing to one background
thread that keeps a few placed batches ready, so the next batch's copy overlaps the
step under way and the loop only dispatches. On a CPU the "device" is the same cores
as the host: the thread's hand-offs cost more than they hide (measured in
``python -m benchmarks host_placement``), so there the loop places batches itself
(``placement='auto'``). Either way the batches, their order and the data state a
checkpoint records are the same.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from jax.sharding import NamedSharding

Placed = TypeVar("Placed")

JOIN_SECONDS = 10.0
"""How long ``close`` waits for the thread to finish the batch it is building."""


def places_in_thread(placement: str, sharding: NamedSharding) -> bool:
    """Whether host batches for ``sharding`` are placed by a thread of their own.

    ``'thread'`` and ``'loop'`` say so; ``'auto'`` uses a thread where the devices are
    accelerators (GPU, TPU) and the loop's thread on a CPU.

    Examples:
        >>> import meshkit
        >>> sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
        >>> places_in_thread("auto", sharding), places_in_thread("thread", sharding)
        (False, True)
    """
    if placement == "auto":
        return next(iter(sharding.device_set)).platform != "cpu"
    return placement == "thread"


class PlacedAhead(Generic[Placed], Iterator[Placed]):
    """``place(item)`` for each item of ``items``, run in a daemon thread ``ahead`` items early.

    ``next()`` returns the placed items in order and raises the thread's error (with
    its traceback) at the item where it happened, after the items placed before it.
    Only the thread touches ``items`` until ``close()``, which stops the
    thread (after the item it is building) and closes ``items``.

    Examples:
        >>> ahead = PlacedAhead(iter(range(5)), lambda i: i * i, ahead=2)
        >>> list(ahead)
        [0, 1, 4, 9, 16]
        >>> ahead.close()
    """

    def __init__(
        self,
        items: Iterator[Any],
        place: Callable[[Any], Placed],
        *,
        ahead: int,
        name: str = "meshkit-placing",
    ):
        self._items = items
        self._place = place
        self._ahead = max(1, ahead)
        self._ready: collections.deque[Placed] = collections.deque()
        self._changed = threading.Condition()
        self._finished = False  # the thread ended: items exhausted, an error, or closed
        self._error: BaseException | None = None
        self._closing = False
        self._paused = False  # held(): the thread waits before its next item
        self._building = False  # the thread is reading or placing an item
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    while (len(self._ready) >= self._ahead or self._paused) and not self._closing:
                        self._changed.wait()
                    if self._closing:
                        return
                    self._building = True
                try:
                    item = next(self._items)
                except StopIteration:
                    return
                placed = self._place(item)
                with self._changed:
                    self._ready.append(placed)
                    self._building = False
                    self._changed.notify_all()
        except BaseException as error:  # handed to the loop's thread, raised there
            with self._changed:
                self._error = error
        finally:
            with self._changed:
                self._finished, self._building = True, False
                self._changed.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[list[Placed]]:
        """Stops the thread between items and hands over the items placed ahead, in
        order; the thread goes on when the block ends. Inside the block the caller may
        read ``items`` itself (``finished`` says whether the thread ended: then its error
        or the end comes from ``next()``)."""
        with self._changed:
            self._paused = True
            while self._building:
                self._changed.wait()
            ready = list(self._ready)
            self._ready.clear()
        try:
            yield ready
        finally:
            with self._changed:
                self._paused = False
                self._changed.notify_all()

    @property
    def finished(self) -> bool:
        """Whether the thread ended: ``items`` ran out, failed, or ``close()``."""
        return self._finished

    def __next__(self) -> Placed:
        with self._changed:
            while not self._ready and not self._finished:
                self._changed.wait()
            if self._ready:
                self._changed.notify_all()  # room for the thread to place the next one
                return self._ready.popleft()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration

    def __iter__(self) -> PlacedAhead[Placed]:
        return self

    def stop(self) -> None:
        """Tells the thread to stop after the item it is building, without waiting: for
        an owner that was dropped without ``close()`` (its finalizer)."""
        with self._changed:
            self._closing = True
            self._ready.clear()
            self._changed.notify_all()

    def close(self) -> None:
        """Stops the thread after the item it is building, then closes ``items``."""
        self.stop()
        self._thread.join(JOIN_SECONDS)
        close = getattr(self._items, "close", None)
        if close is not None and not self._thread.is_alive():
            close()
