"""Bounded windows of queued steps: the default depth per backend, and the window itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import meshkit
from meshkit import train


def test_one_device_queues_three_steps():
    one = meshkit.make_mesh("data=1", devices=jax.devices()[:1])
    assert train.parts.InFlight.for_mesh(one).limit == 3


@pytest.mark.devices(8)
def test_several_cpu_devices_queue_one_step():
    assert train.parts.InFlight.for_mesh(meshkit.make_mesh("data=-1")).limit == 1


@pytest.mark.parametrize("limit", [1, 3])
def test_window_waits_for_the_oldest_and_keeps_the_order(limit):
    window = train.parts.InFlight(limit)
    step = jax.jit(lambda x: x + 1)
    x, done = jnp.zeros(()), []
    for k in range(7):
        x = step(x)
        finished = window.push(k, x)
        assert len(window) <= limit
        for item in finished:
            assert item == len(done)  # oldest first, none skipped
            done.append(item)
    assert len(done) == 7 - limit
    done.extend(window.drain())
    assert done == list(range(7)) and len(window) == 0


@pytest.mark.parametrize(
    ("limit", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_window_needs_a_positive_int(limit, error):
    with pytest.raises(error, match=f"max_in_flight must be an int >= 1 step, got {limit!r}"):
        train.parts.InFlight(limit)
