"""A pmap program in the style of Flax's ImageNet example comes across whole: its model
with ``BatchNorm(axis_name="batch")`` runs unchanged (``per_device``), per-device batch
statistics are there when wanted, and its checkpoints import into a meshkit state.

The reference is the pmap program itself (``pmap_imagenet``), run in the test."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pmap_imagenet as ref
import pytest

import meshkit
from meshkit import ensemble
from meshkit.testing import run_processes
from meshkit.train import (
    LossOutput,
    Model,
    apply_model,
    create_train_state,
    import_flax_checkpoint,
    linen_model,
    make_train_step,
    per_device,
    state_shardings_of,
)

BATCH = 32
STEPS = 4


def example_loss(params: Any, state: Any, batch: Any, rng: jax.Array) -> Any:
    """The example's loss (cross-entropy + weight penalty) through ``apply_model``."""
    logits, collections = apply_model(state, batch["image"], params=params, rng=rng)
    return ref.loss_of(logits, batch["label"], params), LossOutput(collections, {})


@functools.cache
def batches() -> list[dict[str, np.ndarray]]:
    return ref.data(STEPS, BATCH)


@functools.cache
def pmap_run(axis_name: str | None) -> tuple[Any, list[float]]:
    """The pmap program's state (batch stats synced, first replica) and losses."""
    state = ref.create_state(ref.ResNet(axis_name=axis_name))
    state, losses = ref.train(ref.jax_utils.replicate(state), batches())
    state = jax.device_get(ref.jax_utils.unreplicate(ref.sync_batch_stats(state)))
    return state, losses


def meshkit_run(model: Model, mesh: Any) -> tuple[Any, list[float]]:
    state = create_train_state(model, ref.make_tx(), mesh)
    sharding = meshkit.batch_sharding(mesh)
    step = make_train_step(example_loss, state_shardings_of(state), sharding)
    losses = []
    for batch in batches():
        state, metrics = step(state, meshkit.shard_batch(batch, sharding))
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_close(actual: Any, expected: Any, *, atol: float) -> None:
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(meshkit.to_host(actual)),
        jax.tree.leaves(expected),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


def sample() -> jax.Array:
    return jnp.zeros((1, *ref.IMAGE_SHAPE))


def example_model(axis_name: str | None) -> Model:
    """The example's ResNet, initialised as the pmap program initialises it."""
    module = ref.ResNet(axis_name=axis_name)
    model = linen_model(module, sample())
    init = lambda rng: dict(module.init(jax.random.key(0), sample(), train=False))  # noqa: E731
    return dataclasses.replace(model, init=init)


@pytest.mark.devices(8)
@pytest.mark.parametrize("axis_name", ["batch", None], ids=["axis_name=batch", "per-device"])
def test_per_device_model_trains_as_the_pmap_program(axis_name: str | None) -> None:
    """The example's model, unchanged, under ``per_device``: the same losses, parameters
    and batch statistics as pmap, with ``axis_name="batch"`` (global statistics) and
    without it (per-device statistics, which differ from global ones)."""
    mesh = meshkit.make_mesh("data=-1")
    model = example_model(axis_name)
    state, losses = meshkit_run(per_device(model, mesh, axis_name=axis_name), mesh)
    expected, expected_losses = pmap_run(axis_name)
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-5)
    assert_close(state.params, expected.params, atol=2e-6)
    assert_close(state.collections["batch_stats"], expected.batch_stats, atol=2e-6)
    assert int(state.step) == STEPS
    if axis_name is None:  # per-device statistics are not the global ones
        other, _ = pmap_run("batch")
        gap = max(
            float(np.abs(a - b).max())
            for a, b in zip(
                jax.tree.leaves(expected.batch_stats),
                jax.tree.leaves(other.batch_stats),
                strict=True,
            )
        )
        assert gap > 1e-3


@pytest.mark.devices(8)
def test_global_statistics_need_no_wrapper() -> None:
    """Dropping ``axis_name`` under a plain jit gives what pmap's ``axis_name`` gave."""
    mesh = meshkit.make_mesh("data=-1")
    state, losses = meshkit_run(example_model(None), mesh)
    expected, expected_losses = pmap_run("batch")
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-5)
    assert_close(state.collections["batch_stats"], expected.batch_stats, atol=2e-6)


class NamedNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
        return nn.Dense(ref.NUM_CLASSES)(x.reshape(len(x), -1))


@pytest.mark.once
def test_an_unbound_axis_name_says_how_to_fix_it() -> None:
    mesh = meshkit.make_mesh("data=-1")
    model = linen_model(NamedNorm(), sample())
    state = create_train_state(model, ref.make_tx(), mesh)
    sharding = meshkit.batch_sharding(mesh)
    step = make_train_step(example_loss, state_shardings_of(state), sharding)
    batch = meshkit.shard_batch(batches()[0], sharding)
    with pytest.raises(NameError, match=r"per_device\(model, mesh, axis_name='batch'\)") as info:
        step(state, batch)
    assert "drop the axis name" in str(info.value)


@pytest.mark.once
@pytest.mark.devices(8)  # some of its cases need several devices
def test_per_device_refuses_what_it_cannot_run() -> None:
    mesh = meshkit.make_mesh("data=-1")
    model = per_device(linen_model(NamedNorm(), sample()), mesh, axis_name="batch")
    state = create_train_state(model, ref.make_tx(), mesh)
    with pytest.raises(ValueError, match=r"multiple of 8"):
        apply_model(state, jnp.ones((3, *ref.IMAGE_SHAPE)))
    with pytest.raises(ValueError, match="already runs per device"):
        per_device(model, mesh)
    layout = ensemble.EnsembleLayout(meshkit.make_mesh("ensemble=2,data=-1"), 2)
    with pytest.raises(ValueError, match="Ensemble members already run per device"):
        ensemble.create_ensemble_state(model, ref.make_tx(), layout)


# --- checkpoints written by the pmap program ---------------------------------------


@dataclasses.dataclass(frozen=True)
class PmapCheckpoints:
    dirs: dict[str, str]  # variant -> the directory save_checkpoint wrote into
    params: Any  # the saved parameters (first replica)
    accuracy: float  # the pmap program's evaluation of the saved state
    continued_losses: list[float]  # the pmap program's own continuation
    continued_params: Any


@pytest.fixture(scope="module")
def pmap_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> PmapCheckpoints:
    """The pmap program trains, saves (Orbax unreplicated, msgpack replicated, and with a
    dynamic scale), is evaluated, and trains on."""
    state = ref.jax_utils.replicate(ref.create_state(ref.ResNet()))
    state, _ = ref.train(state, batches())
    dirs = {}
    for variant, orbax, unreplicate in [
        ("orbax-unreplicated", True, True),
        ("msgpack-replicated", False, False),
    ]:
        dirs[variant] = str(tmp_path_factory.mktemp(variant))
        with flax_orbax(orbax):
            ref.save(state, dirs[variant], unreplicate=unreplicate)
    scaled = ref.jax_utils.replicate(ref.create_state(ref.ResNet(), half_precision=True))
    dirs["dynamic-scale"] = str(tmp_path_factory.mktemp("dynamic-scale"))
    ref.save(scaled, dirs["dynamic-scale"])
    params = jax.device_get(ref.jax_utils.unreplicate(state.params))
    accuracy = ref.accuracy(state, eval_batch())
    state, losses = ref.train(state, continuation())
    continued = jax.device_get(ref.jax_utils.unreplicate(state.params))
    return PmapCheckpoints(dirs, params, accuracy, losses, continued)


def flax_orbax(enabled: bool) -> Any:
    import contextlib

    import flax

    @contextlib.contextmanager
    def switch() -> Any:
        before = flax.config.flax_use_orbax_checkpointing
        flax.config.update("flax_use_orbax_checkpointing", enabled)
        try:
            yield
        finally:
            flax.config.update("flax_use_orbax_checkpointing", before)

    return switch()


def eval_batch() -> dict[str, np.ndarray]:
    return ref.data(1, 64, seed=2)[0]


def continuation() -> list[dict[str, np.ndarray]]:
    return ref.data(3, BATCH, seed=1)


@functools.cache
def example_state(precision: str = "f32") -> Any:
    """The state a ported program imports into (import_flax_checkpoint does not consume it)."""
    mesh = meshkit.make_mesh("data=-1")
    model = per_device(example_model("batch"), mesh, axis_name="batch")
    return create_train_state(model, ref.make_tx(), mesh, precision=precision)


@pytest.mark.devices(8)
@pytest.mark.parametrize("variant", ["orbax-unreplicated", "msgpack-replicated"])
def test_a_pmap_checkpoint_imports_evaluates_and_continues_as_pmap(
    pmap_checkpoints: PmapCheckpoints, variant: str
) -> None:
    state = import_flax_checkpoint(pmap_checkpoints.dirs[variant], example_state())
    mesh = state.params["Dense_0"]["kernel"].sharding.mesh
    assert int(state.step) == STEPS
    assert_close(state.params, pmap_checkpoints.params, atol=0)
    assert state.params["Dense_0"]["kernel"].sharding.is_fully_replicated

    sharding = meshkit.batch_sharding(mesh)
    images = meshkit.shard_batch(eval_batch(), sharding)
    logits = jax.jit(lambda s, x: apply_model(s, x)[0])(state, images["image"])
    accuracy = float(np.mean(np.argmax(meshkit.to_host(logits), -1) == eval_batch()["label"]))
    assert accuracy == pmap_checkpoints.accuracy

    step = make_train_step(example_loss, state_shardings_of(state), sharding)
    losses = []
    for batch in continuation():
        state, metrics = step(state, meshkit.shard_batch(batch, sharding))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, pmap_checkpoints.continued_losses, rtol=2e-5)
    assert_close(state.params, pmap_checkpoints.continued_params, atol=2e-6)
    assert int(state.step) == STEPS + len(continuation())


@pytest.mark.devices(8)
def test_a_mismatched_checkpoint_lists_the_paths(pmap_checkpoints: PmapCheckpoints) -> None:
    mesh = meshkit.make_mesh("data=-1")
    directory = pmap_checkpoints.dirs["orbax-unreplicated"]
    adam = create_train_state(example_model("batch"), optax.adam(1e-3), mesh)
    with pytest.raises(ValueError) as info:
        import_flax_checkpoint(directory, adam)
    message = str(info.value)
    assert "in the state, not in the checkpoint" in message
    assert "opt_state/0/mu/Dense_0/kernel" in message
    assert "opt_state/0/trace/Dense_0/kernel" in message  # in the checkpoint only
    assert "same optax chain" in message
    assert "precision='f16'" not in message and "its model" not in message  # optimizer only

    scaled = pmap_checkpoints.dirs["dynamic-scale"]
    with pytest.raises(ValueError, match=r"dynamic_scale/scale[\s\S]*precision='f16'"):
        import_flax_checkpoint(scaled, example_state())
    state = import_flax_checkpoint(scaled, example_state("f16"))
    assert state.loss_scale is not None
    assert float(state.loss_scale.scale) == 65536.0 and int(state.loss_scale.good_steps) == 0
    state = import_flax_checkpoint(scaled, example_state(), ignore=["dynamic_scale"])
    assert int(state.step) == 0
    with pytest.raises(FileNotFoundError, match=r"No flax\.training\.checkpoints checkpoint"):
        import_flax_checkpoint(directory, adam, step=123)


@pytest.mark.devices(8)
@pytest.mark.once(8)
@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_msgpack_checkpoint_cut_short_is_named(
    pmap_checkpoints: PmapCheckpoints, tmp_path, keep: float
) -> None:  # type: ignore[no-untyped-def]
    import shutil

    saved = next(Path(pmap_checkpoints.dirs["msgpack-replicated"]).glob("checkpoint_*"))
    cut = tmp_path / saved.name
    shutil.copy(saved, cut)
    data = cut.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=rf"{cut} \({int(len(data) * keep)} bytes\) is cut short"):
        import_flax_checkpoint(str(cut), example_state())


@pytest.mark.devices(8)
@pytest.mark.once(8)
def test_a_checkpointer_pointed_at_a_pmap_programs_folder_says_to_import_it(
    pmap_checkpoints: PmapCheckpoints,
) -> None:
    from meshkit.checkpoint import Checkpointer

    for variant in ("orbax-unreplicated", "msgpack-replicated"):
        checkpointer = Checkpointer(pmap_checkpoints.dirs[variant], save_every=1)
        try:  # resuming from it would start over without a word
            with pytest.raises(ValueError, match=r"holds no meshkit checkpoint, but 1 written "
                               r"by flax\.training\.checkpoints \(checkpoint_\d+\).*"
                               r"import_flax_checkpoint\(directory, state\)"):  # fmt: skip
                checkpointer.resume(example_state())
        finally:
            checkpointer.close()


@pytest.mark.devices(8)
@pytest.mark.once(8)
def test_a_relative_path_imports_as_an_absolute_one(
    pmap_checkpoints: PmapCheckpoints, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # Orbax read a relative path into a "pytree structure ... RestoreArgs" error.
    directory = Path(pmap_checkpoints.dirs["orbax-unreplicated"])
    monkeypatch.chdir(directory.parent)
    state = import_flax_checkpoint(directory.name, example_state())
    assert int(state.step) == STEPS
    assert_close(state.params, pmap_checkpoints.params, atol=0)


@pytest.mark.devices(8)
@pytest.mark.once(8)
def test_a_bit_flipped_after_the_first_import_is_caught_by_the_digest_file(
    pmap_checkpoints: PmapCheckpoints, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from flax import serialization
    from flax.training import checkpoints

    # The msgpack format unreplicated, as the Flax examples save it (a replicated one
    # holds 8 copies, which the import checks against each other).
    saved = next(Path(pmap_checkpoints.dirs["msgpack-replicated"]).glob("checkpoint_*"))
    tree = checkpoints.restore_checkpoint(str(saved), target=None)
    copy = tmp_path / saved.name
    copy.write_bytes(serialization.msgpack_serialize(jax.tree.map(lambda x: x[0], tree)))
    record = tmp_path / "imported.json"
    first = import_flax_checkpoint(str(copy), example_state(), digest_file=record)
    (entry,) = json.loads(record.read_text())["checkpoints"].values()
    assert entry["paths"] == [str(copy.resolve())] and entry["name"] == saved.name
    import_flax_checkpoint(str(copy), example_state(), digest_file=record)  # unchanged: fine
    # The record is of what the file holds, not of what an import used: another ignore=
    # is the same checkpoint. An intact copy elsewhere is the same content.
    import_flax_checkpoint(str(copy), example_state(), digest_file=record, ignore=["opt_state"])
    elsewhere = tmp_path / "elsewhere" / saved.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(copy.read_bytes())
    import_flax_checkpoint(str(elsewhere), example_state(), digest_file=record)
    (entry,) = json.loads(record.read_text())["checkpoints"].values()
    assert entry["paths"] == [str(copy.resolve()), str(elsewhere.resolve())]
    # One bit inside the kernel's bytes: the format has no checksum, so without the
    # record it imports different values without a word.
    data = bytearray(copy.read_bytes())
    kernel = np.asarray(pmap_checkpoints.params["Dense_0"]["kernel"]).tobytes()
    at = bytes(data).index(kernel[:32]) + len(kernel) // 2
    data[at] ^= 0x10
    copy.write_bytes(bytes(data))
    changed = import_flax_checkpoint(str(copy), example_state())
    assert not np.array_equal(meshkit.to_host(changed.params["Dense_0"]["kernel"]),
                              meshkit.to_host(first.params["Dense_0"]["kernel"]))  # fmt: skip
    expected = (
        r"no longer holds what its first import read \(recorded in .*imported\.json\): "
        r"1 of \d+ arrays differ \(params/Dense_0/kernel\)"
    )
    with pytest.raises(ValueError, match=expected):
        import_flax_checkpoint(str(copy), example_state(), digest_file=record)
    # The same damage in a copy at a new path: not known to be that checkpoint, so a
    # warning that names the one it resembles.
    damaged = tmp_path / "third" / saved.name
    damaged.parent.mkdir()
    damaged.write_bytes(copy.read_bytes())
    with pytest.warns(UserWarning, match=r"has the name and arrays of the checkpoint imported"):
        import_flax_checkpoint(str(damaged), example_state(), digest_file=record)
    record.write_text('{"checkpoints": {')  # a record cut short
    with pytest.raises(ValueError, match=r"The digest record .*imported\.json is damaged"):
        import_flax_checkpoint(str(copy), example_state(), digest_file=record)


def continue_imported(directory: str) -> dict[str, Any]:
    """In each of several processes: import the pmap checkpoint, train three more steps."""
    state = import_flax_checkpoint(directory, example_state())
    sharding = meshkit.batch_sharding(state.params["Dense_0"]["kernel"].sharding.mesh)
    rows = meshkit.data_shard(sharding, BATCH).slice
    step = make_train_step(example_loss, state_shardings_of(state), sharding)
    losses = []
    for batch in continuation():
        local = {key: value[rows] for key, value in batch.items()}
        state, metrics = step(state, meshkit.shard_batch(local, sharding))
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": meshkit.to_host(state.params), "step": int(state.step)}


@pytest.mark.multiprocess
@pytest.mark.devices(8)
def test_two_processes_import_and_continue_as_the_pmap_program(
    pmap_checkpoints: PmapCheckpoints,
) -> None:
    directory = pmap_checkpoints.dirs["msgpack-replicated"]
    for result in run_processes(continue_imported, directory, timeout=240):
        assert result["step"] == STEPS + len(continuation())
        np.testing.assert_allclose(result["losses"], pmap_checkpoints.continued_losses, rtol=2e-5)
        assert_close(result["params"], pmap_checkpoints.continued_params, atol=5e-6)
