"""Train and eval pipelines, and the global batch iterator, on one process."""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

import meshkit
from meshkit.data import (
    ArraySource,
    EvalPipeline,
    GlobalBatchIterator,
    InputSettings,
    TrainPipeline,
)


def make_source(n: int = 100) -> ArraySource:
    x = np.arange(n, dtype=np.float32)
    return ArraySource({"x": x, "y": (np.arange(n) % 7).astype(np.int32)})


def pipeline(source=None, batch=16, mesh="data=-1", **kwargs) -> TrainPipeline:
    sharding = meshkit.batch_sharding(meshkit.make_mesh(mesh))
    return TrainPipeline(
        source or make_source(), global_batch_size=batch, sharding=sharding, **kwargs
    )


def global_batches(iterator: GlobalBatchIterator, steps: int) -> list[np.ndarray]:
    with iterator:
        return [meshkit.to_host(next(iterator)["x"]) for _ in range(steps)]


def test_each_epoch_visits_every_kept_example_once_in_a_new_order():
    p = pipeline(batch=16, seed=5)
    assert p.steps_per_epoch == 6  # 100 // 16: the last 4 examples of each epoch are dropped
    epochs = []
    for epoch in range(3):
        rows = np.concatenate([p.global_indices(epoch * 6 + s) for s in range(6)])
        assert len(rows) == len(set(rows.tolist())) == 96
        epochs.append(rows)
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    np.testing.assert_array_equal(np.sort(p.epoch_order(1)), np.arange(100))


def test_seed_and_epoch_do_not_alias():
    assert not np.array_equal(pipeline(seed=1).epoch_order(0), pipeline(seed=0).epoch_order(1))
    assert not np.array_equal(pipeline(seed=0).epoch_order(0), pipeline(seed=1).epoch_order(0))


def test_batches_match_indices_and_resume_is_exact():
    p = pipeline(batch=16, seed=2)
    source_x = make_source().arrays["x"]
    straight = [b["x"] for b, _ in zip(p.dataset(), range(10), strict=False)]
    for step, batch in enumerate(straight):
        np.testing.assert_array_equal(batch, source_x[p.global_indices(step)])
    resumed = [b["x"] for b, _ in zip(p.dataset(start_step=4), range(6), strict=False)]
    for a, b in zip(straight[4:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_iterator_state_round_trip_resumes_exactly():
    p = pipeline(batch=16, seed=9)
    full = global_batches(GlobalBatchIterator(p), 8)
    first = GlobalBatchIterator(p)
    for _ in range(3):
        next(first)
    state = first.state()
    first.close()
    assert state == {
        "step": 3,
        "seed": 9,
        "shuffle": True,
        "global_batch_size": 16,
        "fingerprint": p.fingerprint,
    }
    resumed = global_batches(GlobalBatchIterator(p, state=state), 5)
    for a, b in zip(full[3:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 1}, "seed: saved 0, now 1"),
        ({"batch": 24}, "global_batch_size: saved 16, now 24"),
        ({"source": make_source(99)}, "fingerprint: saved"),
        ({"shuffle": False}, "shuffle: saved True, now False"),
    ],
)
def test_resume_refuses_a_different_pipeline(change, message):
    saved = {"step": 2, **pipeline(seed=0, batch=16).state_fields()}
    other = pipeline(
        source=change.get("source"),
        batch=change.get("batch", 16),
        seed=change.get("seed", 0),
        shuffle=change.get("shuffle", True),
    )
    with pytest.raises(ValueError, match="Cannot resume") as info:
        GlobalBatchIterator(other, state=saved)
    assert message in str(info.value)


def test_resume_refuses_another_shuffle_setting_in_both_directions():
    saved = {"step": 2, **pipeline(shuffle=False).state_fields()}
    assert saved["shuffle"] is False
    with pytest.raises(ValueError, match="shuffle: saved False, now True"):
        GlobalBatchIterator(pipeline(shuffle=True), state=saved)
    with pytest.raises(TypeError, match="shuffle must be True or False, got 'no'"):
        pipeline(shuffle="no")


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_state_saved_without_shuffle_still_resumes_exactly(shuffle):
    """Data states saved before ``shuffle`` was recorded: unknown, warned about, not refused."""
    p = pipeline(batch=16, seed=3, shuffle=shuffle)
    full = global_batches(GlobalBatchIterator(p), 4)
    old = {"step": 2, "seed": 3, "global_batch_size": 16, "fingerprint": p.fingerprint}
    with pytest.warns(UserWarning, match=rf"no \['shuffle'\] .* used shuffle={shuffle}"):
        resumed = GlobalBatchIterator(p, state=old)
    for a, b in zip(full[2:], global_batches(resumed, 2), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):
        GlobalBatchIterator(p, state={k: v for k, v in old.items() if k != "seed"})


def test_finite_pipeline_stops_and_has_length():
    p = pipeline(source=make_source(96), batch=24, num_epochs=2, shuffle=False)
    iterator = GlobalBatchIterator(p)
    assert len(iterator) == 8
    batches = [meshkit.to_host(b["x"]) for b in iterator]
    assert len(batches) == 8 and len(iterator) == 0
    np.testing.assert_array_equal(np.concatenate(batches[:4]), np.arange(96))
    with pytest.raises(StopIteration):
        next(iterator)
    iterator.close()


def test_closed_iterator_says_so():
    iterator = GlobalBatchIterator(pipeline(), prefetch=1)
    next(iterator)
    iterator.close()
    with pytest.raises(RuntimeError, match="was closed"):
        next(iterator)


@pytest.mark.devices(8)
def test_global_batches_do_not_depend_on_the_mesh():
    def augment(record, rng):
        return {"x": record["x"] + rng.normal(), "y": record["y"]}

    layouts = ["data=8", "data=4,model=2", "data=2,model=4"]
    streams = [
        global_batches(
            GlobalBatchIterator(pipeline(mesh=m, batch=16, seed=4, transform=augment)), 5
        )
        for m in layouts
    ]
    for other in streams[1:]:
        for a, b in zip(streams[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.allclose(streams[0][0], np.round(streams[0][0]))  # augmentation ran


def test_pipeline_errors_are_clear():
    with pytest.raises(ValueError, match="fewer than one global batch of 128"):
        pipeline(batch=128)
    with pytest.raises(TypeError, match="ArraySource"):
        pipeline(source=[1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_epochs must be"):
        pipeline(num_epochs=0)
    if jax.device_count() == 8:
        with pytest.raises(ValueError, match="multiple of the 8 shards"):
            pipeline(batch=12)


EVAL_SIZES = sorted({0, 1, 7, 8, 9, 4097, jax.device_count() - 1 or 1, jax.device_count() + 1})


@pytest.mark.parametrize("n", EVAL_SIZES)
def test_eval_pipeline_visits_every_example_exactly_once(n):
    batch = 8 * 16
    source = ArraySource({"x": np.arange(n, dtype=np.float32) * 3})
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    p = EvalPipeline(source, global_batch_size=batch, sharding=sharding)
    assert p.num_steps == math.ceil(n / batch)
    seen_index, seen_x, masks = [], [], 0
    with GlobalBatchIterator(p) as batches:
        for b in batches:
            host = meshkit.to_host(b)
            assert host["x"].shape == (batch,)
            mask = host["mask"]
            masks += int(mask.sum())
            seen_index.append(host["index"][mask])
            seen_x.append(host["x"][mask])
            assert (host["index"][~mask] == -1).all() and (host["x"][~mask] == 0).all()
    assert masks == n
    if n:
        np.testing.assert_array_equal(np.concatenate(seen_index), np.arange(n))
        np.testing.assert_array_equal(np.concatenate(seen_x), np.arange(n) * 3)


def test_eval_transform_applies_to_real_rows_only():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    source = ArraySource({"x": np.arange(5.0)})
    p = EvalPipeline(
        source, global_batch_size=8, sharding=sharding, transform=lambda r: {"x": r["x"] + 1}
    )
    (only,) = list(p.dataset())
    np.testing.assert_array_equal(only["x"], [1, 2, 3, 4, 5, 0, 0, 0])


class Growing:
    """A source whose length can change after a pipeline was built over it."""

    fingerprint = "growing"

    def __init__(self, n: int):
        self.x = list(range(n))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"x": np.float32(self.x[index])}  # type: ignore[dict-item]

    def __repr__(self) -> str:
        return f"Growing({len(self.x)})"


def test_eval_pipeline_refuses_a_source_that_grew_or_shrank():
    """Once planned for 10 examples, a pass over 13 would silently leave 3 out."""
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    source = Growing(10)
    p = EvalPipeline(source, global_batch_size=8, sharding=sharding)
    assert sum(int(b["mask"].sum()) for b in p.local_batches()) == 10
    source.x += [10, 11, 12]
    for start in (lambda: next(GlobalBatchIterator(p)), lambda: next(p.local_batches())):
        with pytest.raises(ValueError) as info:
            start()
        message = str(info.value)
        assert "EvalPipeline had 10 examples when the pipeline was built and has 13 now" in (
            message
        ), message
        assert "Growing(13)" in message and "build a new pipeline" in message
    source.x = source.x[:10]
    unthreaded = EvalPipeline(
        source, global_batch_size=8, sharding=sharding, input_settings=InputSettings(num_threads=0)
    )
    batches = unthreaded.local_batches()  # built one by one as asked: none built ahead
    next(batches)
    source.x = source.x[:9]  # shrinks mid-pass: refused before the next batch is built
    with pytest.raises(ValueError, match=r"had 10 examples .* has 9 now"):
        next(batches)


def test_train_pipeline_refuses_a_source_that_grew():
    source = Growing(40)
    p = pipeline(source=source, batch=8)  # type: ignore[arg-type]
    next(p.local_batches())
    source.x.append(40)
    with pytest.raises(ValueError, match=r"TrainPipeline had 40 examples .* has 41 now"):
        p.local_batch(1)


class RecordByRecord:
    """A source without ``getitems``: read one record at a time, like encoded files."""

    def __init__(self, source: ArraySource):
        self.source = source
        self.fingerprint = source.fingerprint

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        return self.source[index]


def jitter(record, rng):
    return {"x": record["x"] + rng.normal(), "y": record["y"]}


@pytest.mark.once
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_per_example_batches_do_not_depend_on_threads_or_read_path(kind):
    def make(source, num_threads):
        if kind == "train":
            return pipeline(
                source,
                batch=16,
                seed=3,
                transform=jitter,
                input_settings=InputSettings(num_threads=num_threads),
            )
        return EvalPipeline(
            source,
            global_batch_size=16,
            sharding=meshkit.batch_sharding(meshkit.make_mesh("data=-1")),
            transform=lambda record: {"x": record["x"] * 2, "y": record["y"]},
            input_settings=InputSettings(num_threads=num_threads),
        )

    reference = make(make_source(), 0)
    assert reference.per_example
    expected = [reference.local_batch(step) for step in range(2, 7)]
    for source, threads in [(make_source(), 3), (RecordByRecord(make_source()), 2)]:
        p = make(source, threads)
        got = list(zip(p.dataset(start_step=2), range(5), strict=False))
        assert len(got) == 5
        for want, (batch, _) in zip(expected, got, strict=True):
            assert sorted(batch) == sorted(want)
            for key in want:
                np.testing.assert_array_equal(batch[key], want[key])
    if isinstance(reference, TrainPipeline):  # the RNG is keyed by the global position
        epoch_1 = reference.local_batch(reference.steps_per_epoch)
        rng = np.random.default_rng([3, 1, 1, 0])
        x = make_source().arrays["x"][reference.global_indices(reference.steps_per_epoch)[0]]
        assert epoch_1["x"][0] == x + rng.normal()
    else:  # the padded rows of the last batch, step 6 of 7
        last = expected[-1]
        assert last["mask"].tolist() == [True] * 4 + [False] * 12
        assert last["index"].tolist() == [96, 97, 98, 99] + [-1] * 12


def shift_label(record, rng):
    """A transform with a bug: label 9 becomes 10, outside the source's 10 classes."""
    return {**record, "label": np.asarray(record["label"] + 1)}


@pytest.mark.parametrize("threads", [0, 2])
def test_a_transform_that_maps_labels_out_of_the_classes_names_the_example(threads):
    source = ArraySource(
        {"x": np.arange(40, dtype=np.float32), "label": np.arange(40) % 10}, num_classes=10
    )
    bad = pipeline(
        source, batch=8, transform=shift_label, input_settings=InputSettings(num_threads=threads)
    )
    expected = (
        r"ArraySource after the transform function: label 10 at source index (\d+) "
        r"is outside the classes \[0, 10\)"
    )
    with pytest.raises(ValueError, match=expected) as info, GlobalBatchIterator(bad) as batches:
        for _ in range(5):
            next(batches)
    found = re.search(r"source index (\d+)", str(info.value))
    assert found is not None
    index = int(found.group(1))
    assert index % 10 == 9  # the example whose label was 9
    # Grain's note ("has removed its internal frames") would print below the message.
    assert not any("Grain" in note for note in getattr(info.value, "__notes__", []))


def test_unknown_input_keywords_and_settings_that_are_not_input_settings_are_refused():
    source = make_source()
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_threads'"):
        pipeline(source, num_threads=2)  # the keyword of earlier releases is gone
    with pytest.raises(TypeError, match="unexpected keyword argument 'threads'"):
        pipeline(source, threads=2)
    with pytest.raises(
        TypeError, match=r"must be a meshkit.data.InputSettings, got \{'num_threads': 2\}"
    ):
        pipeline(source, input_settings={"num_threads": 2})


@pytest.mark.once
def test_a_batchs_generators_are_numpys_default_rng_bit_for_bit():
    from meshkit.data._generators import generators

    rng = np.random.default_rng(0)
    for prefix in ([0, 1, 0], [7, 1, 3], [2**32 - 1, 1, 2**31], [2**40, 1, 0]):  # the last: numpy's
        last = [0, 1, 127, 2**32 - 1, *rng.integers(0, 2**32, 64).tolist()]
        for made, value in zip(generators(prefix, last), last, strict=True):
            numpy_s = np.random.default_rng([*prefix, value])
            assert made.bit_generator.state == numpy_s.bit_generator.state, (prefix, value)
            assert made.random(3).tolist() == numpy_s.random(3).tolist()
            children = [g.integers(1 << 30) for g in made.spawn(2) + made.spawn(1)]
            assert children == [g.integers(1 << 30) for g in numpy_s.spawn(2) + numpy_s.spawn(1)]
