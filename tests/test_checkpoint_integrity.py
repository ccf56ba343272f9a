"""Checkpoint integrity: the state digest, damaged files, fallback, a full disk during a save."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from tqdm import tqdm

import meshkit
from meshkit import checkpoint, data, train
from meshkit._compiles import count_compiles
from meshkit.checkpoint import _digest
from meshkit.checkpoint._digest import tree_digest
from meshkit.testing import run_processes
from meshkit.train._interval import IntervalRead
from meshkit.train._records import Records


def numpy_digest(x: np.ndarray) -> list[int]:
    """The digest written out in numpy: sums of bits × (2i + 1) and bits × (i·0x9E3779B1 | 1)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        bits = x.astype(np.uint64).reshape(-1)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
        bits = np.ascontiguousarray(x).reshape(-1).view(unsigned).astype(np.uint64)
    position = np.arange(bits.size, dtype=np.uint64)
    linear = (2 * position + 1) % 2**32
    mixed = (position * 0x9E3779B1) % 2**32 | 1
    return [int((bits * linear % 2**32).sum() % 2**32), int((bits * mixed % 2**32).sum() % 2**32)]


def values() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(size=(64, 64)).astype(np.float32),  # 16 KB: its own data chunk
        "half": rng.normal(size=(8, 4)).astype(jnp.bfloat16),
        "byte": rng.integers(0, 256, size=(8, 4)).astype(np.uint8),
        "mask": rng.random(8) > 0.5,
        "step": np.int32(7),
    }


def placed(tree: dict[str, np.ndarray], mesh, spec=None) -> dict[str, jax.Array]:
    """``tree`` on ``mesh``: arrays split by ``spec`` (rows over ``data``), scalars replicated."""
    spec = P("data") if spec is None else spec
    return {
        name: jax.device_put(value, NamedSharding(mesh, spec if np.ndim(value) else P()))
        for name, value in tree.items()
    }


@pytest.mark.once(8)
@pytest.mark.parametrize("on_host", [False, True], ids=["devices", "numpy"])
def test_digest_matches_numpy_on_any_mesh_and_sees_one_bit(on_host):
    """The devices' program and the library's numpy twin (what one process of CPU
    devices uses) against the reference written out here."""
    expected = {name: numpy_digest(value) for name, value in values().items()}
    assert tree_digest(values(), on_host=on_host) == expected  # host values, on one device
    for shape, spec in (("data=-1", P("data")), ("data=-1", P()), ("data=-1,model=1", P("model"))):
        mesh = meshkit.make_mesh(shape)
        digest = tree_digest(placed(values(), mesh, spec), on_host=on_host)
        assert digest == expected, (shape, spec)
    key = {"rng": jax.random.key(3)}
    assert tree_digest(key) == {"rng": numpy_digest(np.asarray(jax.random.key_data(key["rng"])))}
    bits = values()["w"].view(np.uint32).copy()
    bits[17, 3] ^= 1 << 31  # the sign bit of one value
    assert tree_digest({"w": bits.view(np.float32)})["w"] != expected["w"]


@pytest.mark.once(8)
def test_a_prepared_checkpointer_saves_and_restores_without_compiling_the_digest(
    tmp_path, monkeypatch
):
    """Where the digest is a program (accelerators, several processes), ``prepare``
    compiles it in the background from the leaves' shapes and shardings alone (the
    leaves may be donated right after): the save and the restore compile none of it."""
    monkeypatch.setattr(_digest, "_digests_on_host", lambda arrays: False)
    mesh = meshkit.make_mesh("data=-1")
    tree = placed(values(), mesh)
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    donated = jax.tree.map(jnp.copy, tree)
    checkpointer.prepare(donated)
    jax.tree.map(lambda leaf: leaf.delete(), donated)
    with count_compiles() as log:
        checkpointer.save(1, tree, {"step": 1})
        checkpointer.wait()
        restored, _ = checkpointer.restore(tree)
    checkpointer.close()
    assert log.count("digest") == 0, log.events
    assert tree_digest(restored) == {name: numpy_digest(v) for name, v in values().items()}


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def save_two_steps(directory: Path, mesh, steps: int = 2) -> dict[int, dict[str, np.ndarray]]:
    """Steps 1 and 2 (to ``steps``) of a tree sharded over ``data``; the values saved at each."""
    saved = {}
    checkpointer = checkpoint.Checkpointer(directory, save_every=1, keep=steps + 1)
    for step in range(1, steps + 1):
        saved[step] = {name: value + step for name, value in values().items() if name != "mask"}
        checkpointer.save(step, placed(saved[step], mesh), {"step": step})
    checkpointer.close()
    return saved


def damage(step_folder: Path, kind: str, process: int | str = "*") -> Path:
    """Damages the largest OCDBT data file of a step (the one holding ``w``), or of the
    files ``process`` wrote (its rows of ``w``: the files only that process reads)."""
    files = step_folder.glob(f"state/ocdbt.process_{process}/d/*")
    chunk = max(files, key=os.path.getsize)
    content = bytearray(chunk.read_bytes())
    middle = len(content) // 2
    if kind == "delete":
        chunk.unlink()
        return chunk
    if kind == "bit flip":
        content[middle] ^= 0x10
    elif kind == "overwrite":
        content[middle : middle + 8] = b"\xff" * 8
    elif kind == "truncate":
        del content[middle:]
    chunk.write_bytes(bytes(content))
    return chunk


DAMAGE = {
    "bit flip": r"1 of 4 arrays differ from the digest saved with it \(w\)",
    "overwrite": r"1 of 4 arrays differ from the digest saved with it \(w\)",
    "truncate": r"it could not be read \(ValueError: OUT_OF_RANGE: Error reading \"w/",
    "delete": r"it could not be read \(ValueError: .*Error reading \"w/",
}


@pytest.mark.once
@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_named_and_resume_falls_back_to_the_newest_intact_step(tmp_path, kind):
    mesh = meshkit.make_mesh("data=-1")
    saved = save_two_steps(tmp_path, mesh)
    damage(tmp_path / "2", kind)
    target = placed(saved[2], mesh)
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1, keep=3)
    with pytest.raises(checkpoint.CheckpointDamagedError, match=DAMAGE[kind]) as info:
        checkpointer.restore(target)
    assert info.value.step == 2 and info.value.folder == tmp_path / "2"
    assert f"step 2 in {tmp_path / '2'} is damaged" in str(info.value)
    assert "\n" not in str(info.value) and "Move that folder" in str(info.value)

    with pytest.warns(UserWarning, match=r"step 2 .* is damaged: .*Resuming from step 1") as warned:
        resumed = checkpointer.resume(target)
    assert resumed is not None and resumed.step == 1 and resumed.data == {"step": 1}
    assert resumed.set_aside == (tmp_path / "2.damaged",)
    assert str(tmp_path / "2.damaged") in str(warned[0].message)
    for name, value in saved[1].items():
        np.testing.assert_array_equal(meshkit.to_host(resumed.state[name]), value)
    assert names(tmp_path) == ["1", "2.damaged"]
    assert checkpointer.save(2, placed(saved[2], mesh), {"step": 2})  # step 2 can be saved again
    checkpointer.wait()
    assert checkpointer.latest_step() == 2
    checkpointer.close()


@pytest.mark.once
def test_when_no_checkpoint_is_intact_resume_raises_and_moves_nothing(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    saved = save_two_steps(tmp_path, mesh)
    damage(tmp_path / "2", "bit flip")
    damage(tmp_path / "1", "truncate")
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    with pytest.raises(
        checkpoint.CheckpointDamagedError,
        match=r"No checkpoint in .* is intact: step 2: .*",
    ) as raised:
        checkpointer.resume(placed(saved[2], mesh))
    checkpointer.close()
    assert names(tmp_path) == ["1", "2"]
    # The message names each step's damage: no chain of Orbax's tracebacks before it
    # (a recipe printed 168 lines, the error buried in the middle; now 30, it last).
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    from meshkit.checkpoint._orbax import _abandoned_read

    read = 'OUT_OF_RANGE: Error reading "params.kernel/0" in OCDBT database at local file'
    assert _abandoned_read(ValueError(read))  # TensorStore's unretrieved futures: silent
    assert not _abandoned_read(ValueError("OUT_OF_RANGE: something of the user's"))


@pytest.mark.once
def test_a_deleted_digest_is_damage_and_an_older_checkpoint_restores_with_a_warning(tmp_path):
    import json
    import shutil

    mesh = meshkit.make_mesh("data=-1")
    saved = save_two_steps(tmp_path, mesh)
    target = placed(saved[2], mesh)
    shutil.rmtree(tmp_path / "2" / "digest")
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    with pytest.raises(checkpoint.CheckpointDamagedError, match=r"step 2 .* could not be read"):
        checkpointer.restore(target)
    metadata = tmp_path / "2" / "_CHECKPOINT_METADATA"
    content = json.loads(metadata.read_text())
    del content["item_handlers"]["digest"]  # as written before checkpoints held a digest
    metadata.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match="has no digest .* restored without verification"):
        state, _ = checkpointer.restore(target)
    checkpointer.close()
    np.testing.assert_array_equal(meshkit.to_host(state["w"]), saved[2]["w"])


@pytest.fixture
def full_disk(monkeypatch):
    """Makes the data item's write in Orbax's background commit fail with ENOSPC."""

    async def no_space(self, item, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))

    def fill():
        monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", no_space)

    return fill


@pytest.mark.once
def test_a_failed_background_save_is_reported_at_the_next_step(tmp_path, full_disk):
    tree = {"w": jnp.ones((8, 8))}
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=10)
    checkpointer.save(10, tree, {"step": 10})
    checkpointer.wait()
    full_disk()
    assert checkpointer.save(20, tree, {"step": 20})  # started; fails in the background
    deadline = time.monotonic() + 30
    with pytest.raises(checkpoint.CheckpointSaveError) as info:
        while time.monotonic() < deadline:
            checkpointer.should_save(21)
            time.sleep(0.01)
    message = str(info.value)
    assert "\n" not in message
    assert f"Saving the checkpoint of step 20 in {tmp_path} failed: [Errno 28] " in message
    assert "No space left on device" in message and "Free space on that file system" in message
    assert (
        "stopped at step 21 and the partial folder 20.orbax-checkpoint-tmp was removed" in message
    )
    assert message.endswith("then rerun the same command to resume from step 10.")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert names(tmp_path) == ["10"]  # the partial folder is gone
    checkpointer.close()  # reports nothing twice
    assert checkpoint.Checkpointer(tmp_path, save_every=10).latest_step() == 10


@pytest.mark.once
def test_fit_stops_at_the_step_after_a_failed_save(tmp_path, full_disk):
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    pipeline = data.TrainPipeline(data.digits("train"), global_batch_size=64, sharding=sharding)

    def init(rng):
        return {"params": {"w": 0.01 * jax.random.normal(rng, (64, 10))}}

    def apply(variables, images, *, train=False, rngs=None, mutable=False):
        return images.reshape(images.shape[0], -1) @ variables["params"]["w"]

    state = train.create_train_state(train.Model(init=init, apply=apply), optax.sgd(0.1), mesh)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    taken = []

    def slow_step(state, batch):  # room for the failing write to end before the next save
        taken.append(len(taken) + 1)
        if len(taken) == 10:
            full_disk()
        time.sleep(0.03 if len(taken) > 10 else 0)
        return step(state, batch)

    with pytest.raises(
        checkpoint.CheckpointSaveError, match=r"step 10 in .* failed: \[Errno 28\]"
    ) as info:
        train.fit(
            state, slow_step, pipeline, num_steps=40, workdir=tmp_path,
            checkpoints=train.Checkpoints(every=10), logging=train.Logging(progress=False),
        )  # fmt: skip
    assert 10 < taken[-1] < 20  # reported before the next save, not by it
    assert f"Training stopped at step {taken[-1]} and the partial folder 10." in str(info.value)
    assert names(tmp_path / "checkpoints") == []


@pytest.mark.once
def test_the_non_finite_message_calls_the_checkpoint_verified_on_resume_not_good(tmp_path):
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=10)
    checkpointer.save(10, {"w": jnp.ones(2)}, {"step": 10})
    checkpointer.wait()
    records = Records([], tqdm(disable=True), checkpointer, learning_rate=None)
    read = IntervalRead(first=11, last=20, means={"loss": float("nan")}, first_bad_step=15)
    with pytest.raises(train.NonFiniteLossError) as info:
        records.interval(read, paused=0.0, input_wait=0.0)
    checkpointer.close()
    message = str(info.value)
    assert "good" not in message
    assert f"step 10 in {tmp_path}, was saved before it and is kept (verified" in message


def save_damage_resume(directory: str) -> tuple[dict[str, list[int]], int, list[str], list[str]]:
    """Every process saves steps 1 to 4, process 0 damages steps 2 to 4, all resume.

    Step 4 has a flipped bit (every process compares the same digest); step 3 has a
    file that every process reads cut short; step 2 a file that only process 0 reads.
    Returns step 4's digest as saved, the step resumed from, the folders set aside and
    the warnings.
    """
    mesh = meshkit.make_mesh("data=-1")
    saved = save_two_steps(Path(directory), mesh, steps=4)
    multihost_utils.sync_global_devices("saved")
    if jax.process_index() == 0:
        damage(Path(directory) / "4", "bit flip")
        for process in range(jax.process_count()):
            damage(Path(directory) / "3", "truncate", process)
        damage(Path(directory) / "2", "truncate", process=0)
    multihost_utils.sync_global_devices("damaged")
    checkpointer = checkpoint.Checkpointer(directory, save_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = checkpointer.resume(placed(saved[4], mesh))
    checkpointer.close()
    assert resumed is not None
    digest = tree_digest(placed(saved[4], mesh))
    found = [str(warning.message) for warning in caught]
    return digest, resumed.step, [path.name for path in resumed.set_aside], found


@pytest.mark.multiprocess
def test_two_processes_fall_back_together_whichever_process_finds_the_damage(tmp_path):
    results = run_processes(save_damage_resume, str(tmp_path))
    saved = {name: value + 4 for name, value in values().items() if name != "mask"}
    digest, step, set_aside, found = results[0]
    assert digest == tree_digest(saved)  # the digest of one process
    assert (step, set_aside) == (1, ["4.damaged", "3.damaged", "2.damaged"])
    assert results[1] == results[0]  # the same steps, warnings and words on both
    assert len(found) == 3
    assert re.search(r"step 4 .* 1 of 4 arrays differ from the digest .*\(w\)", found[0])
    for message, count in zip(found[1:], (2, 1), strict=True):
        assert 'it could not be read (ValueError: OUT_OF_RANGE: Error reading "w/' in message
        assert f"(process 0's finding; {count} of 2 processes found damage)" in message
        assert "Resuming from step 1" in message
    mesh = meshkit.make_mesh("data=-1")  # this process's own devices: another mesh
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1)
    saved = {name: value + 1 for name, value in values().items() if name != "mask"}
    state, _ = checkpointer.restore(placed(saved, mesh), step=1)  # verified
    checkpointer.close()
    np.testing.assert_array_equal(meshkit.to_host(state["w"]), saved["w"])


@pytest.mark.once
def test_an_edited_data_state_is_damage_and_resume_falls_back(tmp_path):
    mesh = meshkit.make_mesh("data=-1")
    saved = save_two_steps(tmp_path, mesh)
    data_file = tmp_path / "2" / "data" / "metadata"  # Orbax's JSON item: {"step": 2}
    data_file.write_text(json.dumps(json.loads(data_file.read_text()) | {"step": 7}))
    checkpointer = checkpoint.Checkpointer(tmp_path, save_every=1, keep=3)
    with pytest.raises(
        checkpoint.CheckpointDamagedError,
        match=r'its data state \{"step": 7\} differs from the digest saved with it',
    ):
        checkpointer.restore(placed(saved[2], mesh))
    with pytest.warns(UserWarning, match=r"step 2 .* is damaged: its data state .*step 1"):
        resumed = checkpointer.resume(placed(saved[2], mesh))
    assert resumed is not None and resumed.step == 1 and resumed.data == {"step": 1}
    checkpointer.close()


FILL_THE_DISK = """
import sys
import meshkit
meshkit.distributed.initialize(cpu_devices=2)
import flax.linen as nn, jax.numpy as jnp, numpy as np, optax
from meshkit import data, train
mesh = meshkit.make_mesh("data=-1")
sharding = meshkit.batch_sharding(mesh)
rng = np.random.default_rng(0)
source = data.ArraySource(
    {"image": rng.normal(size=(256, 64)).astype(np.float32), "label": rng.integers(0, 2, 256)}
)
pipeline = data.TrainPipeline(source, global_batch_size=16, sharding=sharding)
model = train.linen_model(nn.Dense(512), jnp.zeros((1, 64)))
state = train.create_train_state(model, optax.adam(0.1), mesh)
step = train.make_train_step(train.classification_loss, train.state_shardings_of(state), sharding)
train.fit(state, step, pipeline, num_steps=40, workdir=sys.argv[1],
          checkpoints=train.Checkpoints(every=10), logging=train.Logging(every=5, progress=False))
"""


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str = "600k") -> Iterator[Path]:
    """A real, small file system: a ``size`` tmpfs under ``tmp_path``, unmounted after.

    The second checkpoint of ``FILL_THE_DISK`` (about 400 KiB of parameters and Adam
    moments) cannot fit. Skips when not root or when mounting fails.
    """
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.multiprocess
def test_a_full_disk_is_said_in_one_last_line(tmp_path: Path):
    # A real full file system: a 600 KiB tmpfs, where the second checkpoint (about
    # 400 KiB of parameters and Adam moments) cannot fit. Orbax reports it through
    # TensorStore as RESOURCE_EXHAUSTED, its threads log it, and its abandoned writes
    # complain at exit; the run must end on one line that names the full disk.
    import subprocess
    import sys

    with small_tmpfs(tmp_path) as disk:
        run = subprocess.run(
            [sys.executable, "-c", FILL_THE_DISK, str(disk / "run")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 1, lines[-20:]
    assert lines[-1].startswith(
        "meshkit.checkpoint._checkpointer.CheckpointSaveError: Saving the checkpoint of step 20 in "
    ), lines[-20:]
    assert "failed: No space left on device (or the disk quota is exceeded)." in lines[-1]
    assert "Free space on that file system (or keep fewer checkpoints)" in lines[-1]
    assert "resume from step 10" in lines[-1]
    # Before: 293 lines, the summary in the middle, Orbax's traceback chained to it and
    # its abandoned writes complaining at exit, and TensorStore's callbacks into the
    # save's closed event loop ("Event loop is closed", 112 of 386 lines, some after
    # the error). Now Orbax's log line for each failed thread, then the error's own
    # short traceback and nothing after it.
    assert not any("Event loop is closed" in line for line in lines), lines
    assert sum(line.startswith("Traceback") for line in lines) == 1, lines
    last = lines.index("Traceback (most recent call last):")
    assert len(lines) - last < 25, "\n".join(lines[last:])
    assert not any("site-packages/orbax" in line for line in lines[last:]), lines[last:]
    assert not any("sys.meta_path is None" in line for line in lines)


@pytest.mark.multiprocess
def test_a_recipe_on_a_full_disk_prints_one_line_and_so_does_its_rerun(tmp_path: Path):
    # As a user types it: the default model (3.1 MiB of parameters) on a 900 KiB disk.
    import subprocess
    import sys

    command = [sys.executable, "-m", "recipes.data_parallel", "--checkpoint-every", "10"]
    with small_tmpfs(tmp_path, size="900k") as disk:
        for _ in range(2):  # the rerun finds the disk as full
            run = subprocess.run(
                [*command, "--workdir", str(disk / "run"), "--no-progress"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
            assert run.stderr.startswith(
                f"Saving the checkpoint of step 10 in {disk}/run/checkpoints failed: No "
                "space left on device (or the disk quota is exceeded). Training stopped at "
            ), run.stderr
            assert run.stderr.rstrip().endswith("then rerun the same command to start over.")


@pytest.mark.multiprocess
def test_a_full_disk_on_two_processes_ends_the_job_on_that_one_line(tmp_path: Path):
    # The same full disk, shared by 2 processes × 2 devices under meshkit.launch: the
    # process that finds it says so last, and the other one stops with one line.
    import subprocess
    import sys

    script = tmp_path / "fill.py"
    script.write_text(FILL_THE_DISK.replace("initialize(cpu_devices=2)", "initialize()"))
    command = [sys.executable, "-m", "meshkit.launch", "-n", "2", "-d", "2", "--timeout", "120"]
    with small_tmpfs(tmp_path) as disk:
        run = subprocess.run(
            [*command, "--", sys.executable, str(script), str(disk / "run")],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    lines = [
        line for line in (run.stdout + run.stderr).strip().splitlines() if "[Gloo]" not in line
    ]
    assert run.returncode == 1, lines[-30:]
    last = re.match(
        r"\[(\d)\] \[meshkit\] Process (\d) failed with CheckpointSaveError: Saving the "
        r"checkpoint of step 20 in .*No space left on device",
        lines[-1],
    )
    assert last is not None and last.group(1) == last.group(2), lines[-30:]
    failed = int(last.group(1))
    other = 1 - failed
    assert any(
        (
            line.startswith(f"[{other}] [meshkit] Process {other} ")
            and f"process {failed} failed with CheckpointSaveError" in line
        )
        or line.startswith(f"[{other}] [meshkit] Process {other} failed too")
        for line in lines
    ), lines[-30:]
    tail = lines[max(i for i, line in enumerate(lines) if "Traceback" in line) :]
    assert not any("site-packages/orbax" in line for line in tail), tail
    assert "Terminating process" not in run.stdout + run.stderr
