"""fit's writers (metrics.jsonl, TensorBoard, W&B), hooks, learning-rate records, profiling,
and its keywords of earlier releases."""

from __future__ import annotations

import json
import struct
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboardX.proto import event_pb2

import meshkit
from meshkit import checkpoint, data, train

# writers, hooks and profiles; fit's device behaviour is tested elsewhere
pytestmark = pytest.mark.once

BATCH = 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


def run_fit(
    workdir, *, num_steps=20, schedule=None, eval_every=None, writers=(), state=None, **kwargs
):
    mesh = meshkit.make_mesh("data=1", devices=jax.devices()[:1])  # the features, not the mesh
    sharding = meshkit.batch_sharding(mesh)
    schedule = schedule or optax.linear_schedule(0.1, 0.0, 40)
    model = train.linen_model(MLP(), jnp.zeros((1, 8, 8, 1)))
    if state is None:
        state = train.create_train_state(model, optax.sgd(schedule, momentum=0.9), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    return train.fit(
        state,
        step,
        data.TrainPipeline(data.digits("train"), global_batch_size=BATCH, sharding=sharding),
        num_steps=num_steps,
        workdir=workdir,
        evaluation=train.Evaluation(
            data.EvalPipeline(data.digits("test"), global_batch_size=BATCH, sharding=sharding),
            every=eval_every,
        ),
        logging=train.Logging(every=5, progress=False, writers=writers, learning_rate=schedule),
        **kwargs,
    )


def read_events(logdir):
    """Every event in ``logdir``'s event files, read from the TFRecord framing directly."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        raw = path.read_bytes()
        offset = 0
        while offset < len(raw):
            (length,) = struct.unpack("<Q", raw[offset : offset + 8])
            record = raw[offset + 12 : offset + 12 + length]
            events.append(event_pb2.Event.FromString(record))  # pyright: ignore[reportAttributeAccessIssue]
            offset += 12 + length + 4  # length, its CRC, the record, its CRC
    return events


def scalars(events):
    return {
        (value.tag, event.step): value.simple_value
        for event in events
        for value in event.summary.value
    }


def test_records_reach_jsonl_and_tensorboard_with_learning_rate_and_throughput(tmp_path):
    seen = []
    result = run_fit(
        tmp_path,
        eval_every=10,
        writers=[train.TensorBoardWriter(tmp_path / "tb")],
        hooks=[seen.append],
    )
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    training = [line for line in lines if "loss" in line]
    assert [line["step"] for line in training] == [5, 10, 15, 20]
    # the rate of each record's last step: linear from 0.1 to 0 over 40 updates
    assert [round(line["learning_rate"], 6) for line in training] == [0.09, 0.0775, 0.065, 0.0525]
    assert "steps_per_second" not in training[0]  # the first record includes compilation
    assert all(
        line["steps_per_second"] > 0 and 0 <= line["input_wait"] <= 1 for line in training[1:]
    )

    tensorboard = scalars(read_events(tmp_path / "tb"))
    for line in lines:
        for name, value in line.items():
            if name not in {"step", "time"}:
                assert tensorboard[(name, line["step"])] == pytest.approx(value, rel=1e-6)
    assert tensorboard[("eval/accuracy", 20)] == pytest.approx(result.eval_metrics["accuracy"])

    kinds = [(boundary.kind, boundary.step) for boundary in seen]
    assert kinds == [
        ("log", 5),
        ("log", 10),
        ("eval", 10),
        ("log", 15),
        ("log", 20),
        ("checkpoint", 20),
        ("eval", 20),
    ]
    assert seen[2].metrics["accuracy"] == pytest.approx(lines[2]["eval/accuracy"])


def test_a_resumed_run_hides_the_steps_an_earlier_run_recorded_after_its_checkpoint(tmp_path):
    every_10 = train.Checkpoints(every=10)
    run_fit(
        tmp_path, num_steps=15, checkpoints=every_10, writers=[train.TensorBoardWriter(tmp_path)]
    )
    (tmp_path / "checkpoints" / "15").rename(tmp_path / "15.elsewhere")  # as if killed at 15
    run_fit(
        tmp_path, num_steps=20, checkpoints=every_10, writers=[train.TensorBoardWriter(tmp_path)]
    )
    events = read_events(tmp_path)
    restarts = [event.step for event in events if event.HasField("session_log")]
    assert restarts == [11]  # TensorBoard drops the first run's events from step 11 on
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(steps) and steps.count(15) == 1


def test_a_state_trained_elsewhere_continues_from_its_own_step(tmp_path):
    whole = run_fit(tmp_path / "whole", num_steps=15)
    first = run_fit(tmp_path / "first", num_steps=8)
    assert int(first.state.step) == 8
    # A new workdir, no checkpoint: the run continues from state.step, to 15 in all.
    rest = run_fit(tmp_path / "rest", num_steps=15, state=first.state)
    assert rest.step == 15 and int(rest.state.step) == 15
    records = [json.loads(line) for line in (tmp_path / "rest" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [10, 15]
    whole_records = {
        r["step"]: r
        for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl").open())
        if "learning_rate" in r
    }
    for record in records:
        if "learning_rate" in record:  # the schedule's value at the run's own steps
            assert record["learning_rate"] == whole_records[record["step"]]["learning_rate"]
    assert (
        checkpoint.Checkpointer(tmp_path / "rest" / "checkpoints", save_every=1).latest_step() == 15
    )
    # The pipeline continued at batch 8: the same run as one never split.
    for got, want in zip(
        jax.tree.leaves(meshkit.to_host(rest.state.params)),
        jax.tree.leaves(meshkit.to_host(whole.state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"already taken 15 steps.*num_steps=55"):
        run_fit(tmp_path / "again", num_steps=10, state=rest.state)


def test_early_stopping_saves_and_stops_at_the_next_step(tmp_path):
    stop = train.EarlyStopping("loss", kind="log", mode="min", patience=1, min_delta=10.0)
    result = run_fit(tmp_path, num_steps=40, hooks=[stop])
    # The first record sets the best; the second (step 10) cannot improve by 10: stop.
    # Records are read once the step has left the queue, so the stop comes at most
    # max_in_flight + 1 steps later, with a checkpoint of the step it stops at.
    assert result.stopped_early and not result.preempted
    assert 10 < result.step <= 11 + result.max_in_flight
    assert (
        checkpoint.Checkpointer(tmp_path / "checkpoints", save_every=100).latest_step()
        == result.step
    )


def test_profile_steps_write_a_trace(tmp_path):
    run_fit(tmp_path, num_steps=6, dispatch=train.Dispatch(profile_steps=(3, 2)))
    traces = list((tmp_path / "profile" / "process_0").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    with pytest.raises(ValueError, match=r"profile_steps must be \(first_step, count\).*got 3"):
        train.Dispatch(profile_steps=3)  # pyright: ignore[reportArgumentType]


def test_profile_steps_outside_the_run_are_said_before_it_trains(tmp_path):
    with pytest.warns(UserWarning, match=r"asks for steps 10-14, but this run trains steps "
                      r"1-5: no profile will be written"):  # fmt: skip
        run_fit(tmp_path / "none", num_steps=5, dispatch=train.Dispatch(profile_steps=(10, 5)))
    assert not (tmp_path / "none" / "profile").exists()
    with pytest.warns(UserWarning, match=r"only steps 4-6 will be traced"):
        run_fit(tmp_path / "part", num_steps=6, dispatch=train.Dispatch(profile_steps=(4, 5)))
    assert list((tmp_path / "part" / "profile" / "process_0").rglob("*.xplane.pb"))


def test_wandb_writer_logs_offline_runs(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = train.WandbWriter(tmp_path / "wandb", config={"seed": 0})
    writer.start(10)
    writer.write(15, {"loss": 0.5, "member_loss": [1.0, 2.0]})
    writer.close()
    init = calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path / "wandb")
    assert init["config"] == {"seed": 0, "resumed_from": 10}
    assert calls[1:] == [
        ("log", 15, {"loss": 0.5, "member_loss/0": 1.0, "member_loss/1": 2.0}),
        ("finish",),
    ]


def test_fit_refuses_unknown_keywords_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'checkpoint_every'"):
        run_fit(tmp_path, checkpoint_every=10)  # the keyword of earlier releases is gone
    assert not (tmp_path / "checkpoints").exists()  # refused before any work


def test_a_tensorboard_logdir_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "tb").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=r"TensorBoard logdir .*tb is a file"):
        run_fit(tmp_path / "run", writers=[train.TensorBoardWriter(tmp_path / "tb")])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_fit_holds_its_workdir_and_leaves_a_users_records_alone(tmp_path):
    (tmp_path / "mine" / "metrics.jsonl").parent.mkdir()
    (tmp_path / "mine" / "metrics.jsonl").write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(train.WorkdirError, match=r"holds metrics\.jsonl, which meshkit did not"):
        run_fit(tmp_path / "mine")
    assert (tmp_path / "mine" / "metrics.jsonl").read_text() == "epoch,loss\n1,0.5\n"


def test_an_object_store_workdir_without_its_client_names_the_package(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    registry = importlib.import_module("fsspec.registry")._registry  # the writable one
    for scheme in ("gs", "gcs"):  # nor registered in this process (another test may have)
        monkeypatch.delitem(registry, scheme, raising=False)
    mesh = meshkit.make_mesh("data=-1")
    for first_write in (run_fit, lambda workdir: train.parts.write_run_config(workdir, {}, mesh)):
        with pytest.raises(ImportError) as info:
            first_write("gs://bucket/run")
        message = str(info.value)
        assert message.startswith("The workdir gs://bucket/run is on Google Cloud Storage")
        assert 'pip install "meshkit[gcs]"' in message and "TensorStore" in message


def test_an_object_store_workdir_without_a_network_to_it_ends_in_one_line(monkeypatch):
    """With gcsfs installed and no network, its retries took 51 s and 149 lines."""
    import socket
    import types

    import fsspec

    from meshkit import _paths
    from recipes._args import setup_errors_in_one_line

    client = types.new_class("GCSFileSystem")
    client.__module__ = "gcsfs.core"  # what fsspec returns when gcsfs is installed
    monkeypatch.setattr(fsspec, "get_filesystem_class", lambda scheme: client)

    def no_network(host, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    _paths._resolve.cache_clear()
    mesh = meshkit.make_mesh("data=-1")
    with pytest.raises(SystemExit) as stop, setup_errors_in_one_line():
        train.parts.write_run_config("gs://bucket/run", {}, mesh)
    assert str(stop.value.code) == (
        "The workdir gs://bucket/run is on Google Cloud Storage, but its host "
        "storage.googleapis.com cannot be reached from this machine (gaierror: [Errno -2] "
        "Name or service not known). Run where Google Cloud Storage is reachable, or use a "
        "local workdir."
    )
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://localhost:4443")
    assert _paths._store_host("gs") == "localhost"  # an emulator is checked, not GCS
    _paths._resolve.cache_clear()


@pytest.mark.once
def test_a_run_config_that_differs_from_the_checkpointed_run_is_refused_by_name(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    train.parts.write_run_config(tmp_path, {"learning_rate": 0.1, "steps": 10}, mesh)
    train.parts.write_run_config(
        tmp_path, {"learning_rate": 0.5, "steps": 10}, mesh
    )  # no checkpoint
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    train.parts.write_run_config(tmp_path, {"learning_rate": 0.5, "steps": 40, "mesh": "x"}, mesh)
    with pytest.raises(ValueError, match=r"learning_rate 0\.5 \(now 0\.1\), seed unset \(now 3\)"):
        train.parts.write_run_config(tmp_path, {"learning_rate": 0.1, "steps": 40, "seed": 3}, mesh)
    recorded = json.loads((tmp_path / "config.json").read_text())["arguments"]
    assert recorded == {"learning_rate": 0.5, "steps": 40, "mesh": "x"}  # the refused one left it
