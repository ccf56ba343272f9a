"""Steps queued on the devices: how many at most, and waiting for the oldest one."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

import jax
from jax.sharding import Mesh

from meshkit._checks import check_int

T = TypeVar("T")


def default_max_in_flight(mesh: Mesh) -> int:
    """How many steps a loop queues by default: 1 on a mesh of several CPU devices, else 3.

    An accelerator runs a step while the host prepares the next ones, so a few queued
    steps keep it busy: reading every step's results, even one step late, leaves a
    GPU idle most of the time for small models. On a mesh of several CPU devices (the
    fake devices tests and rehearsals use), many queued multi-device steps can stall
    XLA:CPU's collective rendezvous and abort the process, so one step is queued at a
    time. A single CPU device has no collectives and queues like an accelerator.

    Examples:
        >>> import jax, meshkit
        >>> default_max_in_flight(meshkit.make_mesh("data=1", devices=jax.devices()[:1]))
        3
    """
    several_cpus = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1
    return 1 if several_cpus else 3


class InFlight(Generic[T]):
    """A window of at most ``limit`` queued steps, each known by a small output array.

    ``push`` adds a step and waits for the oldest ones until at most ``limit`` are
    queued; it returns their items, now complete, oldest first. ``drain`` waits for all.
    ``InFlight.for_mesh(mesh)`` has the depth ``fit`` uses on that mesh.

    Examples:
        >>> import jax.numpy as jnp
        >>> window = InFlight(limit=2)
        >>> [window.push(k, jnp.ones(())) for k in range(4)]
        [[], [], [0], [1]]
        >>> list(window.drain())
        [2, 3]
    """

    def __init__(self, limit: int):
        self.limit = check_int(limit, name="max_in_flight", minimum=1, unit="step")
        self._queued: collections.deque[tuple[T, jax.Array]] = collections.deque()

    @classmethod
    def for_mesh(cls, mesh: Mesh) -> InFlight[T]:
        """An empty window of the default depth for ``mesh``: 1 on a mesh of several CPU
        devices, else 3 (``default_max_in_flight`` says why).

        Examples:
            >>> import meshkit
            >>> InFlight.for_mesh(meshkit.make_mesh("data=-1")).limit in (1, 3)
            True
        """
        return cls(default_max_in_flight(mesh))

    def __len__(self) -> int:
        return len(self._queued)

    def push(self, item: T, token: jax.Array) -> list[T]:
        """Queues ``item`` (done when ``token`` is ready); returns the items waited for."""
        self._queued.append((item, token))
        done = []
        while len(self._queued) > self.limit:
            done.append(self._wait_oldest())
        return done

    def drain(self) -> Iterator[T]:
        """Waits for every queued step, oldest first, yielding each item when it is done."""
        while self._queued:
            yield self._wait_oldest()

    def _wait_oldest(self) -> T:
        item, token = self._queued.popleft()
        token.block_until_ready()
        return item
