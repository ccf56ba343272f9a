"""Workdirs on an object store: ``gs://`` paths kept as URIs from end to end.

An in-memory file system stands in for Google Cloud Storage: it is registered with
fsspec under ``gs``, which is what ``etils.epath`` reads and writes ``gs://`` paths
through when TensorFlow is not installed.
"""

from __future__ import annotations

import importlib
import json

import flax.linen as nn
import fsspec
import jax.numpy as jnp
import optax
import pytest
from etils import epath
from fsspec.implementations.memory import MemoryFileSystem

import meshkit
from meshkit import data, train
from meshkit._paths import as_path

pytestmark = pytest.mark.once  # paths and writers; fit's device behaviour is tested elsewhere


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class InMemoryBucket(MemoryFileSystem):
    """``gs://bucket/...`` kept in this process's memory."""

    protocol = ("gs", "gcs")
    root_marker = ""


@pytest.fixture
def bucket():
    registry = importlib.import_module("fsspec.registry")._registry  # the writable one
    previous = {name: registry.get(name) for name in ("gs", "gcs")}
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, InMemoryBucket, clobber=True)
    InMemoryBucket.store.clear()
    InMemoryBucket.pseudo_dirs.clear()
    yield epath.Path("gs://bucket/run")
    InMemoryBucket.store.clear()
    for name, implementation in previous.items():
        if implementation is None:
            registry.pop(name, None)
        else:
            registry[name] = implementation


def test_gs_paths_stay_uris():
    # pathlib would make this /<cwd>/gs:/bucket/run/checkpoints, a local folder
    assert str(as_path("gs://bucket/run") / "checkpoints") == "gs://bucket/run/checkpoints"
    assert str(as_path("s3://bucket/run")) == "s3://bucket/run"


def test_fit_writes_its_records_to_an_object_store_and_resumes(bucket, tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    model = train.linen_model(Linear(), jnp.zeros((1, 8, 8, 1)))

    def run(num_steps):
        state = train.create_train_state(model, optax.sgd(0.1), mesh)
        step = train.make_train_step(
            train.classification_loss, train.state_shardings_of(state), sharding
        )
        pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding)
        return train.fit(
            state,
            step,
            pipeline,
            num_steps=num_steps,
            workdir="gs://bucket/run",
            # Orbax writes gs:// with its own client
            checkpoints=train.Checkpoints(every=4, directory=tmp_path / "checkpoints"),
            logging=train.Logging(every=2, progress=False),
        )

    train.parts.write_run_config("gs://bucket/run", {"seed": 0}, mesh)
    first = run(6)
    lines = (bucket / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]
    (tmp_path / "checkpoints" / "6").rename(tmp_path / "6.aside")  # as if killed after 6
    second = run(8)
    assert (first.step, second.resumed_from, second.step) == (6, 4, 8)
    steps = [
        json.loads(line)["step"] for line in (bucket / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [2, 4, 6, 8]  # the lines after step 4 were dropped, then written again
    assert json.loads((bucket / "config.json").read_text())["arguments"] == {"seed": 0}
    assert not list(tmp_path.glob("gs*")) and not (tmp_path / "bucket").exists()
