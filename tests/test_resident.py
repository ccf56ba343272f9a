"""Resident datasets and many steps per dispatch: the same batches and the same training.

References: the host pipeline's own batches (bit for bit, several epochs, a batch that
does not divide the dataset), and ``fit`` with host input and one step per dispatch
(state and every logged metric).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import data, evaluate, train
from meshkit.data import image
from meshkit.data._feed import Feed
from meshkit.ensemble import EnsembleLayout, MemberTrainPipeline
from meshkit.models import MnistCNN
from meshkit.testing import run_processes
from meshkit.train._chunks import Calibration, choose_steps, describe_dispatch, probe_steps

STEPS = 9  # three epochs of 50 examples at batch 16 (2 examples dropped per epoch)


class TinyMLP(nn.Module):
    """The benchmark's tiny MLP: 64 inputs, 32 hidden units, 10 classes."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def odd_source() -> data.ArraySource:
    """Fields of four kinds, signed zeros included (a sum would lose their sign)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    x[::7] = -0.0
    return data.ArraySource(
        {
            "x": x,
            "image": rng.integers(0, 256, (50, 4, 4, 1), dtype=np.uint8),
            "label": rng.integers(0, 10, 50),
            "flag": rng.random(50) < 0.5,
        }
    )


def resident_batches(pipeline: data.TrainPipeline, steps: int) -> list[dict[str, np.ndarray]]:
    """Batches ``0 .. steps - 1`` as ``fit`` gathers them on the devices."""
    feed = Feed(pipeline, largest=steps)
    stored, indices, offset = feed.next(steps)
    assert offset == 0
    indices = indices[:steps]
    gathered = jax.jit(lambda d, xs: jax.lax.map(lambda x: feed.batch_of(d, x), xs))(
        stored, indices
    )
    host = meshkit.to_host(gathered)
    return [{key: value[k] for key, value in host.items()} for k in range(steps)]


def host_batches(pipeline: data.TrainPipeline, steps: int) -> list[dict[str, np.ndarray]]:
    with data.GlobalBatchIterator(pipeline) as batches:
        return [meshkit.to_host(next(batches)) for _ in range(steps)]


def assert_bit_identical(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            assert x[key].dtype == y[key].dtype, key
            assert x[key].tobytes() == y[key].tobytes(), key


def streams(mesh_text: str, mode: Any) -> tuple[list[dict], list[dict], str, int]:
    sharding = meshkit.batch_sharding(meshkit.make_mesh(mesh_text))
    common: dict[str, Any] = {"global_batch_size": 16, "sharding": sharding, "seed": 3}
    resident = data.TrainPipeline(
        odd_source(), input_settings=data.InputSettings(resident=mode), **common
    )
    host = data.TrainPipeline(odd_source(), **common)
    return (
        resident_batches(resident, STEPS),
        host_batches(host, STEPS),
        str(resident.resident_mode),
        resident.resident_bytes,
    )


@pytest.mark.once(8)
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_resident_batches_equal_the_host_pipelines_bit_for_bit(mode):
    got, expected, placed, per_device = streams("data=-1", mode)
    assert_bit_identical(got, expected)
    assert placed == mode
    rows = 50 if mode == "replicated" else -(-50 // jax.device_count())
    assert per_device == rows * (3 * 4 + 16 + 4 + 1)  # x, image, label (int32), flag


@pytest.mark.devices(8)
@pytest.mark.once(8)
def test_rows_split_over_two_data_axes_gather_the_same_batches():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("replica=2,data=4"), ("replica", "data"))
    common: dict[str, Any] = {"global_batch_size": 16, "sharding": sharding, "seed": 3}
    got = resident_batches(
        data.TrainPipeline(
            odd_source(), input_settings=data.InputSettings(resident="sharded"), **common
        ),
        4,
    )
    assert_bit_identical(got, host_batches(data.TrainPipeline(odd_source(), **common), 4))


@pytest.mark.devices(8)
@pytest.mark.once(8)
def test_split_rows_are_gathered_with_one_reduce_scatter_per_field_and_never_all_gathered():
    """The dataset's rows stay where they are: no collective gathers them whole."""
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    pipeline = data.TrainPipeline(
        odd_source(),
        global_batch_size=16,
        sharding=sharding,
        input_settings=data.InputSettings(resident="sharded"),
    )
    feed = Feed(pipeline, largest=3)
    stored, indices, _ = feed.next(3)
    gather = jax.jit(lambda d, xs: jax.lax.map(lambda x: feed.batch_of(d, x), xs))
    hlo = gather.lower(stored, indices).compile().as_text() or ""
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert hlo.count("reduce-scatter(") == len(stored)  # one per field, in the loop body


@pytest.mark.once
def test_each_member_gathers_its_own_order():
    layout = EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 3)
    common: dict[str, Any] = {"global_batch_size": 16, "sharding": layout.batch_sharding}
    resident = MemberTrainPipeline(
        odd_source(), 3, input_settings=data.InputSettings(resident=True), **common
    )
    host = MemberTrainPipeline(odd_source(), 3, **common)
    got = resident_batches(resident, 4)
    assert got[0]["x"].shape == (16, 3, 3)
    assert_bit_identical(got, host_batches(host, 4))


@pytest.mark.once
def test_a_dataset_that_fits_nowhere_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("MESHKIT_RESIDENT_BYTES", "1000")
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    with pytest.raises(ValueError) as error:
        data.TrainPipeline(
            odd_source(),
            global_batch_size=16,
            sharding=sharding,
            input_settings=data.InputSettings(resident=True),
        )
    message = str(error.value)
    assert "\n" not in message
    assert "1.6 KiB on every device" in message
    assert "1000 B per device (MESHKIT_RESIDENT_BYTES=1000)" in message
    assert "resident=False" in message


@pytest.mark.once(8)
@pytest.mark.devices(8)
def test_a_dataset_too_large_for_one_device_is_split_over_the_data_axis(monkeypatch):
    monkeypatch.setenv("MESHKIT_RESIDENT_BYTES", "1000")
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    pipeline = data.TrainPipeline(
        odd_source(),
        global_batch_size=16,
        sharding=sharding,
        input_settings=data.InputSettings(resident=True),
    )
    assert pipeline.resident_mode == "sharded"
    assert pipeline.resident_bytes == 7 * 33  # 50 rows over 8 devices: 7 each


@pytest.mark.once(8)
@pytest.mark.devices(8)
def test_a_layout_asked_for_is_checked_against_the_same_limit(monkeypatch):
    monkeypatch.setenv("MESHKIT_RESIDENT_BYTES", "1000")
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))

    def build(resident):
        return data.TrainPipeline(
            odd_source(),
            global_batch_size=16,
            sharding=sharding,
            input_settings=data.InputSettings(resident=resident),
        )

    with pytest.raises(ValueError) as error:
        build("replicated")  # 1.6 KiB on each device; split, 231 B would fit
    assert str(error.value).endswith(
        " needs 1.6 KiB on every device to be resident replicated; "
        "resident data may take 1000 B per device (MESHKIT_RESIDENT_BYTES=1000). Use "
        "resident='sharded' (231 B per device with its rows split over the 8 data shards), "
        "read batches from the host instead (resident=False; --input host in the recipes), "
        "or set MESHKIT_RESIDENT_BYTES to the bytes per device it may take."
    )
    assert build("sharded").resident_bytes == 7 * 33
    monkeypatch.setenv("MESHKIT_RESIDENT_BYTES", "100")
    with pytest.raises(ValueError, match=r"needs 231 B per device to be resident with its rows"):
        build("sharded")


@pytest.mark.once
def test_resident_input_refuses_host_transforms_and_unknown_layouts():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    with pytest.raises(ValueError, match="host transform augment cannot run"):

        def augment(record, rng):
            return record

        data.TrainPipeline(
            odd_source(),
            global_batch_size=16,
            sharding=sharding,
            input_settings=data.InputSettings(resident=True),
            transform=augment,
        )
    with pytest.raises(ValueError, match=r"resident=\.\.\.\) must be True, False, 'replicated' or"):
        data.InputSettings(resident="yes")  # pyright: ignore[reportArgumentType]


@pytest.mark.once
@pytest.mark.parametrize("value", [0, -3, 2.5, "fast", True])
def test_steps_per_dispatch_must_be_a_positive_int_or_auto(value):
    with pytest.raises((TypeError, ValueError), match=r"Dispatch\(steps_per_dispatch=\.\.\.\)"):
        train.Dispatch(steps_per_dispatch=value)


# Timings recorded on this 2-core machine (seconds per step), with the choice they made.
RECORDED = {
    "tiny MLP, 1 CPU device": (
        Calibration(one=361e-6, probe_steps=50, chunk=54e-6),
        50,
    ),
    "tiny MLP, 8 CPU devices": (
        Calibration(one=11e-3, probe_steps=60, chunk=4.7e-3),
        60,
    ),
    "MNIST CNN, 8 CPU devices": (Calibration(one=35e-3, probe_steps=16), 1),
    "unrolled CNN chunk, slower per step": (
        Calibration(one=31e-3, probe_steps=16, chunk=48e-3),
        1,
    ),
    # one NVIDIA H200 (fit_overhead's recorded run)
    "tiny MLP, 1 GPU": (Calibration(one=529e-6, probe_steps=50, chunk=32e-6), 50),
    "MNIST CNN, 1 GPU": (Calibration(one=845e-6, probe_steps=60, chunk=255e-6), 60),
}


@pytest.mark.once
@pytest.mark.parametrize("case", sorted(RECORDED))
def test_auto_chooses_from_recorded_timings_and_noise_does_not_flip_it(case):
    measured, chosen = RECORDED[case]
    assert choose_steps(measured) == chosen
    rng = np.random.default_rng(0)
    for _ in range(200):  # every figure off by up to 25% either way
        noisy = Calibration(
            one=measured.one * rng.uniform(0.75, 1.25),
            probe_steps=measured.probe_steps,
            chunk=None if measured.chunk is None else measured.chunk * rng.uniform(0.75, 1.25),
        )
        assert choose_steps(noisy) == chosen


@pytest.mark.once
def test_an_untimed_or_barely_faster_chunk_leaves_one_step_per_dispatch():
    assert choose_steps(Calibration(one=15e-3, probe_steps=50)) == 1  # untimed
    assert choose_steps(Calibration(15e-3, 50, chunk=14e-3)) == 1  # 7% faster: kept
    assert choose_steps(Calibration(15e-3, 50, chunk=11e-3)) == 50
    no_room = Calibration(one=15e-3, probe_steps=1)
    assert describe_dispatch(1, no_room, auto=True) == (
        "1 step per dispatch (auto: 15 ms per step; no chunk fits between the boundaries)"
    )
    assert probe_steps(100) == 50 and probe_steps(1) == 1 and probe_steps(2) == 1


# --- fit: the same training whatever the input path and the steps per dispatch -------

_STEPS = 200
_TX = optax.sgd(0.05, momentum=0.9)
_MODEL = train.linen_model(TinyMLP(), jnp.zeros((1, 8, 8, 1)))


def _fit(
    workdir: Path,
    *,
    resident: bool,
    steps_per_dispatch: Any,
    num_steps: int = _STEPS,
    placement: Any = "auto",
):
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    state = train.create_train_state(_MODEL, _TX, mesh, seed=0)
    step = _train_step(sharding, train.state_shardings_of(state))
    pipeline = data.TrainPipeline(
        data.digits("train"),
        global_batch_size=64,
        sharding=sharding,
        input_settings=data.InputSettings(resident=resident, placement=placement),
    )
    result = train.fit(
        state,
        step,
        pipeline,
        num_steps=num_steps,
        workdir=workdir,
        checkpoints=train.Checkpoints(every=50),
        logging=train.Logging(every=10, progress=False),
        dispatch=train.Dispatch(steps_per_dispatch=steps_per_dispatch),
    )
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line["loss"] for line in lines if "loss" in line}
    return result, logged


_STEP_CACHE: dict[Any, Any] = {}


def _train_step(sharding, shardings):
    key = (sharding, jax.device_count())
    if key not in _STEP_CACHE:
        _STEP_CACHE[key] = train.make_train_step(train.classification_loss, shardings, sharding)
    return _STEP_CACHE[key]


@pytest.fixture(scope="module")
def per_step_reference(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("host"), resident=False, steps_per_dispatch=1)


@pytest.fixture(scope="module")
def resident_one_step(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("resident"), resident=True, steps_per_dispatch=1)


@pytest.mark.once(8)
@pytest.mark.parametrize(
    ("resident", "steps_per_dispatch", "compiles", "placement"),
    [
        (True, 8, 1, "auto"),  # one program for every count of steps
        (True, "auto", 1, "auto"),
        (False, 8, 1, "auto"),  # host chunks of 8 serve the steps around boundaries
        (False, 1, 1, "thread"),  # host batches placed by a thread of their own
        (False, 8, 1, "thread"),  # its chunks of 8 serve the steps around boundaries too
    ],
)
def test_fit_trains_alike_for_every_input_path_and_chunk_size(
    tmp_path,
    per_step_reference,
    resident_one_step,
    *,
    resident,
    steps_per_dispatch,
    compiles,
    placement,
):
    jax.clear_caches()  # each case counts its own compiles (chunk programs are shared)
    reference, reference_log = per_step_reference
    result, logged = _fit(
        tmp_path, resident=resident, steps_per_dispatch=steps_per_dispatch, placement=placement
    )
    assert result.step == _STEPS
    assert sorted(logged) == sorted(reference_log)  # every 10 steps, whatever the chunk
    for step, loss in reference_log.items():
        np.testing.assert_allclose(logged[step], loss, rtol=1e-6)
    params = jax.tree.leaves(meshkit.to_host(result.state.params))
    for got, expected in zip(
        params, jax.tree.leaves(meshkit.to_host(reference.state.params)), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    if resident:  # the same program at 1 and N steps per dispatch: the same bits
        one_step, _ = resident_one_step
        for got, expected in zip(
            params, jax.tree.leaves(meshkit.to_host(one_step.state.params)), strict=True
        ):
            np.testing.assert_array_equal(got, expected)
    assert result.train_step_compiles == compiles
    assert result.input_path.startswith("resident (replicated" if resident else "host")
    assert result.input_path.endswith("placed by a thread") == (placement == "thread")
    if steps_per_dispatch == 8:
        assert result.steps_per_dispatch == 8
    checkpoints = sorted(
        int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()
    )
    assert checkpoints == [100, 150, 200]  # chunks end at every boundary
    if steps_per_dispatch == "auto":  # its choice, passed on: no calibration, no compile
        assert result.calibration is not None and result.dispatch.startswith(
            f"{result.steps_per_dispatch} step"
        )
        again, _ = _fit(
            tmp_path / "again", resident=True, steps_per_dispatch=result.steps_per_dispatch
        )
        assert again.train_step_compiles == 0 and again.calibration is None


@pytest.mark.once(8)
def test_the_unrolled_step_program_gives_the_counted_loops_bits(
    tmp_path, monkeypatch, resident_one_step
):
    """CPUs unroll convolutions (``loop_for``); the counted loop of the reference is
    what every other step runs."""
    from meshkit.train import _runners

    monkeypatch.setattr(_runners, "loop_for", lambda mesh, jaxpr: "unrolled")
    result, _ = _fit(tmp_path, resident=True, steps_per_dispatch=8)
    assert result.train_step_compiles == 2  # 8 steps, and 1 around the boundaries
    one_step, _ = resident_one_step
    for got, expected in zip(
        jax.tree.leaves(meshkit.to_host(result.state.params)),
        jax.tree.leaves(meshkit.to_host(one_step.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.once
def test_unrolled_chunks_of_a_convolution_step_are_bit_identical_to_single_steps(tmp_path):
    """On a CPU a step with a convolution runs unrolled: no loop, the same program."""
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(MnistCNN(), jnp.zeros((1, 8, 8, 1)))
    state = train.create_train_state(model, _TX, mesh, seed=0)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    params = []
    for n, resident in ((1, True), (4, True)):
        result = train.fit(
            train.create_train_state(model, _TX, mesh, seed=0),
            step,
            data.TrainPipeline(
                data.digits("train"),
                global_batch_size=64,
                sharding=sharding,
                input_settings=data.InputSettings(resident=resident),
            ),
            num_steps=8,
            workdir=tmp_path / str(n),
            logging=train.Logging(every=4, progress=False),
            dispatch=train.Dispatch(steps_per_dispatch=n),
        )
        params.append(jax.tree.leaves(meshkit.to_host(result.state.params)))
    for single, chunked in zip(*params, strict=True):
        np.testing.assert_array_equal(single, chunked)


@pytest.mark.once
def test_a_resident_run_resumes_exactly_where_a_host_run_stopped(tmp_path):
    _fit(tmp_path, resident=False, steps_per_dispatch=1, num_steps=50)
    resumed, _ = _fit(tmp_path, resident=True, steps_per_dispatch=8, num_steps=100)
    assert resumed.resumed_from == 50
    straight, _ = _fit(tmp_path / "straight", resident=True, steps_per_dispatch=8, num_steps=100)
    for got, expected in zip(
        jax.tree.leaves(meshkit.to_host(resumed.state.params)),
        jax.tree.leaves(meshkit.to_host(straight.state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.once
def test_a_run_fed_by_a_placing_thread_resumes_bit_exact(tmp_path):
    """Chunks of 8 against checkpoints every 50: the steps before each boundary come
    from the thread's chunk under way and the chunk after it is rebuilt (the order
    and the data state stay the pipeline's), so a run stopped at 50 and resumed ends
    with the bits of one never stopped."""
    thread = {"resident": False, "steps_per_dispatch": 8, "placement": "thread"}
    _fit(tmp_path, num_steps=50, **thread)
    resumed, logged = _fit(tmp_path, num_steps=100, **thread)
    assert resumed.resumed_from == 50 and resumed.input_path == "host, placed by a thread"
    straight, straight_logged = _fit(tmp_path / "straight", num_steps=100, **thread)
    assert {k: v for k, v in straight_logged.items() if k > 50} == {
        k: v for k, v in logged.items() if k > 50
    }
    for got, expected in zip(
        jax.tree.leaves(meshkit.to_host(resumed.state.params)),
        jax.tree.leaves(meshkit.to_host(straight.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.once
def test_a_plain_python_step_is_refused_for_chunks_with_the_way_out(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding)

    def plain(state, batch):
        return state, {"loss": jnp.mean(batch["image"])}

    with pytest.raises(TypeError, match="need a jitted train step"):
        train.fit(
            jnp.zeros(()),  # pyright: ignore[reportArgumentType]
            plain,
            pipeline,
            num_steps=4,
            workdir=tmp_path,
            dispatch=train.Dispatch(steps_per_dispatch=2),
        )


# --- several processes ------------------------------------------------------------------


def child_streams(records: Path) -> dict[str, Any]:
    """Each layout's resident batches and the host pipeline's, and an evaluation of the
    JPEG test digits from the host and resident, in this process."""
    by_mode: dict[str, Any] = {
        mode: streams("data=-1", mode)[:2] for mode in ("replicated", "sharded")
    }
    host, resident, _ = eval_both_ways("data=-1", records)
    by_mode["evaluation"] = [(r.metrics, r.per_example["logits"]) for r in (host, resident)]
    return by_mode


@pytest.mark.multiprocess
@pytest.mark.devices(8)
def test_two_processes_gather_the_same_batches_and_evaluate_alike(jpeg_records):
    one_process = child_streams(jpeg_records["test"])
    for by_mode in run_processes(child_streams, jpeg_records["test"]):
        (host_metrics, host_logits), (metrics, logits) = by_mode.pop("evaluation")
        assert metrics == host_metrics == one_process["evaluation"][1][0]
        assert logits.tobytes() == host_logits.tobytes()
        for mode, (got, host) in by_mode.items():
            assert_bit_identical(got, host)
            assert_bit_identical(got, one_process[mode][0])


# --- decoded once, and evaluation sets ----------------------------------------------------


@pytest.fixture(scope="module")
def jpeg_records(tmp_path_factory) -> dict[str, Path]:
    return data.write_digits_images(tmp_path_factory.mktemp("jpeg"), size=12)


@pytest.mark.once(8)
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_jpeg_records_decoded_once_give_the_host_pipelines_batches(jpeg_records, mode):
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    common: dict[str, Any] = {
        "global_batch_size": 400,  # 1,437 training images: three batches an epoch, 37 dropped
        "sharding": sharding,
        "seed": 5,
        "transform": image.decode_transform(12),
    }
    source = data.image_records(jpeg_records["train"])
    resident = data.TrainPipeline(
        source, input_settings=data.InputSettings(resident=mode), **common
    )
    host = data.TrainPipeline(source, **common)
    assert resident.resident_bytes == (
        1437 if mode == "replicated" else -(-1437 // jax.device_count())
    ) * (12 * 12 * 3 + 4)
    assert_bit_identical(resident_batches(resident, 7), host_batches(host, 7))


class MixedSizes:
    """JPEG records of two sizes, as a folder of photos gives."""

    fingerprint = "mixed sizes"

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> dict[str, Any]:
        side = 16 if index < 13 else 20
        return {"image": image.encode(np.zeros((side, side, 3), np.uint8)), "label": 0}


@pytest.mark.once
def test_resident_records_of_several_sizes_are_refused_naming_the_example():
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    pipeline = data.TrainPipeline(
        MixedSizes(),  # pyright: ignore[reportArgumentType]
        global_batch_size=8,
        sharding=sharding,
        transform=image.decode_transform(),
        input_settings=data.InputSettings(resident=True),
    )
    with pytest.raises(ValueError, match=r"example 13's 'image' has shape \(20, 20, 3\) but"):
        _ = pipeline.resident_data
    sized = data.TrainPipeline(
        MixedSizes(),  # pyright: ignore[reportArgumentType]
        global_batch_size=8,
        sharding=sharding,
        transform=image.decode_transform(16),
        input_settings=data.InputSettings(resident=True),
    )
    assert sized.resident_data is not None
    assert sized.resident_data.arrays["image"].shape == (20, 16, 16, 3)


def eval_both_ways(mesh_text: str, records: Path) -> tuple[Any, Any, data.EvalPipeline]:
    """``full_eval`` of a fixed linear model over the JPEG test digits (360: not a
    multiple of the batch), from the host and resident."""
    sharding = meshkit.batch_sharding(meshkit.make_mesh(mesh_text))
    transform = image.eval_transform(12, mean=0.5, std=0.25, crop_fraction=1.0)
    weights = np.random.default_rng(0).normal(size=(12 * 12 * 3, 10)).astype(np.float32)

    def per_example(w, batch):
        logits = batch["image"].reshape(batch["image"].shape[0], -1) @ w
        labels = batch["label"]
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
            "logits": logits,
        }

    results = []
    for resident in (False, True):
        pipeline = data.EvalPipeline(
            data.image_records(records),
            global_batch_size=64,
            sharding=sharding,
            transform=transform,
            input_settings=data.InputSettings(resident=resident),
        )
        results.append(evaluate.full_eval(per_example, weights, pipeline, collect=["logits"]))
    return results[0], results[1], pipeline


@pytest.mark.once(8)
@pytest.mark.parametrize("mesh_text", ["data=-1", "data=2,fsdp=-1"])
def test_a_resident_evaluation_equals_the_host_one_example_for_example(jpeg_records, mesh_text):
    if mesh_text != "data=-1" and jax.device_count() != 8:
        pytest.skip("two data axes: the 8-device pass")
    host, resident, pipeline = eval_both_ways(mesh_text, jpeg_records["test"])
    assert resident.count == host.count == 360 and resident.num_steps == host.num_steps == 6
    assert resident.metrics == host.metrics  # the same images, decoded once
    assert resident.per_example["logits"].tobytes() == host.per_example["logits"].tobytes()
    rows_per_device = pipeline.sharding.shard_shape((64,))[0]
    assert pipeline.resident_bytes == 6 * rows_per_device * (12 * 12 * 3 * 4 + 4)


@pytest.mark.once
def test_a_resident_evaluation_set_too_large_is_refused_when_built(monkeypatch, jpeg_records):
    monkeypatch.setenv("MESHKIT_RESIDENT_BYTES", "1e5")
    sharding = meshkit.batch_sharding(meshkit.make_mesh("data=-1"))
    with pytest.raises(ValueError, match=r"needs 649\.5 KiB per device to be resident") as error:
        data.EvalPipeline(
            data.image_records(jpeg_records["test"]),
            global_batch_size=64,
            sharding=sharding,
            transform=image.eval_transform(12, mean=0.5, std=0.25, crop_fraction=1.0),
            input_settings=data.InputSettings(resident=True),
        )
    assert "resident=False" in str(error.value) and "\n" not in str(error.value)
