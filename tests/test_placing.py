"""Host batches placed by a thread of their own: the same batches, errors and state as the loop's.

References: the batches the training loop places itself (bit for bit, several epochs,
a global batch that does not divide the dataset), its error at the same batch, and
``fit``'s training with loop placement (in test_resident.py).
"""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from jax.dtypes import canonicalize_dtype

import meshkit
from meshkit import data
from meshkit.data._ahead import PlacedAhead, places_in_thread
from meshkit.data._feed import Feed
from tests.test_resident import assert_bit_identical

STEPS = 9  # three epochs of 50 examples at batch 16


def source() -> data.ArraySource:
    rng = np.random.default_rng(0)
    return data.ArraySource(
        {
            "x": rng.normal(size=(50, 3)).astype(np.float32),
            "label": rng.integers(0, 10, 50),
            "id": np.arange(50),
        }
    )


def pipeline(placement: str, **kwargs: Any) -> data.TrainPipeline:
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    return data.TrainPipeline(
        source(),
        global_batch_size=16,
        sharding=sharding,
        seed=3,
        input_settings=data.InputSettings(placement=placement),  # type: ignore[arg-type]
        **kwargs,
    )


def stream(batches: Any, steps: int) -> list[dict[str, np.ndarray]]:
    return [meshkit.to_host(next(batches)) for _ in range(steps)]


def placing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "meshkit-placing"]


def test_a_placing_thread_gives_the_loops_batches_and_data_state():
    with data.GlobalBatchIterator(pipeline("loop")) as loop:
        expected = stream(loop, STEPS)
    with data.GlobalBatchIterator(pipeline("thread")) as placed:
        first = stream(placed, 4)
        assert placing_threads()
        state = placed.state()
    assert not placing_threads()  # close() stopped it
    assert state["step"] == 4  # batches taken, not batches placed ahead
    with data.GlobalBatchIterator(pipeline("thread"), state=state) as resumed:
        rest = stream(resumed, STEPS - 4)
    assert_bit_identical(first + rest, expected)


@pytest.mark.parametrize(
    "requests",
    [
        # (steps, the chunk size the caller runs): sizes that change at every call
        [(1, 1), (4, 4), (3, 3), (3, 3), (2, 2), (4, 4), (4, 4), (4, 4), (4, 4)],
        # a loop at 4 per dispatch with boundaries that leave 1 or 3 steps
        [(4, 4), (1, 4), (4, 4), (4, 4), (3, 3), (1, 4), (1, 4), (4, 4), (4, 4), (2, 4)],
    ],
    ids=["sizes-change", "boundaries"],
)
def test_a_chunk_feed_with_a_placing_thread_stacks_the_same_steps(requests):
    """The steps a chunk's ``(xs, offset)`` holds are the pipeline's batches of those
    steps, for either placement: chunks are built whole at the size the caller runs, and
    a request that does not fit the chunk under way is built from the same batches."""
    reference = pipeline("loop")
    expected, step = [], 0
    for steps, _ in requests:
        batches = [reference.local_batch(k) for k in range(step, step + steps)]
        stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
        expected.append({k: v.astype(canonicalize_dtype(v.dtype)) for k, v in stacked.items()})
        step += steps
    for placement in ("loop", "thread"):
        feed = Feed(pipeline(placement), largest=4)
        chunks = []
        try:
            for steps, chunk in requests:
                _, xs, offset = feed.next(steps, chunk=chunk)
                placed = meshkit.to_host(xs)
                chunks.append({k: v[offset : offset + steps] for k, v in placed.items()})
            assert feed.state()["step"] == step
        finally:
            feed.close()
        assert feed.describe() == ("host, placed by a thread" if placement == "thread" else "host")
        assert_bit_identical(chunks, expected)
    assert not placing_threads()


def test_a_placing_thread_holds_whole_chunks_and_ends_with_a_short_one():
    """At a steady size the thread's chunks are whole (one transfer each, served in
    turn); a finite pipeline's last chunk is short and then the feed ends."""
    feed = Feed(pipeline("thread", num_epochs=1), largest=2)  # 3 batches of 16 from 50
    try:
        first, second = feed.next(2, chunk=2), feed.next(1, chunk=2)
        assert first[1]["x"].shape[0] == 2 and second[2] == 0  # a new (short) chunk
        with pytest.raises(StopIteration):
            feed.next(2, chunk=2)
    finally:
        feed.close()
    assert not placing_threads()


def _fails_at_example_40(record: dict, rng: np.random.Generator) -> dict:
    del rng
    if int(record["id"]) == 40:
        raise ValueError("example 40 is corrupt")
    return record


def test_an_error_while_placing_is_raised_at_the_batch_it_belongs_to():
    """The batches before it arrive; then the transform's own error, as on the loop."""
    outcomes = {}
    for placement in ("loop", "thread"):
        got = 0
        with (
            data.GlobalBatchIterator(
                pipeline(placement, transform=_fails_at_example_40, shuffle=False)
            ) as batches,
            pytest.raises(ValueError) as raised,
        ):
            for _ in range(STEPS):
                next(batches)
                got += 1
        outcomes[placement] = (got, str(raised.value))
    assert outcomes["thread"] == outcomes["loop"]
    assert outcomes["loop"][0] == 2  # example 40 is in batch 2 (rows 32..47)
    assert "example 40 is corrupt" in outcomes["loop"][1]
    assert not placing_threads()


def test_the_thread_keeps_as_many_placed_items_ready_as_asked():
    placed: list[int] = []
    ahead = PlacedAhead(iter(range(100)), lambda i: placed.append(i) or i, ahead=3)
    try:
        time.sleep(0.2)
        assert len(placed) == 3  # and waits
        assert [next(ahead) for _ in range(2)] == [0, 1]
        time.sleep(0.2)
        assert len(placed) == 2 + 3
        assert next(ahead) == 2
    finally:
        ahead.close()
    assert not ahead._thread.is_alive()


def test_the_placing_thread_is_chosen_for_accelerators_only():
    def on(platform: str) -> Any:
        return SimpleNamespace(device_set=[SimpleNamespace(platform=platform)])

    assert [places_in_thread("auto", on(p)) for p in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert places_in_thread("loop", on("gpu")) is False
    assert places_in_thread("thread", on("cpu")) is True


@pytest.mark.once
def test_an_unknown_placement_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"must be 'auto', 'loop' or 'thread', got 'gpu'"):
        data.InputSettings(placement="gpu")  # type: ignore[arg-type]


def test_a_feed_dropped_without_closing_ends_its_thread():
    """Nothing the placing thread runs refers to its owner, so dropping the owner ends it."""
    batches = data.GlobalBatchIterator(pipeline("thread"))
    next(batches)
    feed = Feed(pipeline("thread"), largest=2)
    feed.next(2)
    assert len(placing_threads()) == 2
    del batches, feed
    gc.collect()
    for _ in range(100):
        if not placing_threads():
            break
        time.sleep(0.05)
    assert not placing_threads()
