"""``python -m meshkit.migrate`` finds every pmap-era idiom of the Flax examples' style,
and nothing in meshkit's own recipes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from meshkit import migrate

pytestmark = pytest.mark.once  # reads source text; no devices involved

ROOT = Path(__file__).resolve().parent.parent

# In the style of Flax's pmap ImageNet example (train.py and models.py).
IMAGENET = """
import functools
import jax
from jax import lax
import jax.numpy as jnp
import flax
from flax import jax_utils
from flax.training import checkpoints, common_utils, dynamic_scale as dynamic_scale_lib
from flax.training import train_state
import flax.linen as nn
import optax


class TrainState(train_state.TrainState):
    batch_stats: dict
    dynamic_scale: dynamic_scale_lib.DynamicScale


class ResNetBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=False, axis_name="batch")
        return norm()(x)


def create_learning_rate_fn(config, base_learning_rate, steps_per_epoch):
    return base_learning_rate


def train_step(state, batch, learning_rate_fn):
    grads = lax.pmean(grads, axis_name="batch")
    metrics = lax.pmean(metrics, axis_name="batch")
    return state, metrics


def sync_batch_stats(state):
    cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def prepare_tf_data(xs):
    local_device_count = jax.local_device_count()
    return xs.reshape((local_device_count, -1) + xs.shape[1:])


def create_input_iter(ds):
    it = map(prepare_tf_data, ds)
    return jax_utils.prefetch_to_device(it, 2)


def train_and_evaluate(config, workdir):
    base_learning_rate = config.learning_rate * config.batch_size / 256.0
    dynamic_scale = dynamic_scale_lib.DynamicScale()
    state = checkpoints.restore_checkpoint(workdir, state)
    state = jax_utils.replicate(state)
    p_train_step = jax.pmap(functools.partial(train_step), axis_name="batch")
    train_metrics = common_utils.get_metrics(train_metrics)
    state = sync_batch_stats(state)
    checkpoints.save_checkpoint(workdir, jax_utils.unreplicate(state), step=0)
"""

# In the style of the Flax MNIST / ensembling HOWTO pmap programs.
HOWTO = """
import jax
import jax.numpy as jnp
from flax.training import common_utils
from flax.jax_utils import pad_shard_unpad, replicate


@jax.pmap
def apply_model(state, images, labels):
    probs = jax.lax.pmean(jax.nn.softmax(logits), axis_name="ensemble")
    index = jax.lax.axis_index("ensemble")
    total = jax.lax.psum(1, "ensemble")
    return probs


def train_epoch(state, train_ds, batch_size, rng):
    rngs = common_utils.shard_prng_key(rng)
    batch = common_utils.shard(batch)
    images = jax.device_put_sharded(list(images), jax.local_devices())
    state = jax.device_put_replicated(state, jax.local_devices())
    learning_rate = 0.1 * jax.device_count()
    evaluate = pad_shard_unpad(apply_model)
    return replicate(state)
"""


def line_of(source: str, text: str, occurrence: int = 0) -> int:
    """The line number of the ``occurrence``-th line of ``source`` that contains ``text``."""
    lines = [n for n, line in enumerate(source.splitlines(), 1) if text in line]
    return lines[occurrence]


def found(findings) -> dict[str, set[int]]:
    lines: dict[str, set[int]] = {}
    for finding in findings:
        lines.setdefault(finding.idiom, set()).add(finding.line)
    return lines


def test_every_idiom_of_the_imagenet_example_is_found():
    lines = found(migrate.scan_source(IMAGENET, "train.py"))
    at = functools.partial(line_of, IMAGENET)
    assert lines == {
        "a TrainState subclass with batch_stats": {at("class TrainState")},
        "flax.training.dynamic_scale.DynamicScale": {
            at("dynamic_scale: dynamic_scale_lib"),
            at("dynamic_scale = dynamic_scale_lib"),
        },
        "BatchNorm(axis_name=...)": {at("nn.BatchNorm")},
        "jax.lax.pmean": {at("grads = lax.pmean"), at("metrics = lax.pmean"), at("lax.pmean(x")},
        "jax.pmap": {at("jax.pmap(lambda"), at("p_train_step")},
        "cross_replica_mean": {at("cross_replica_mean(state")},
        "jax.local_device_count": {at("jax.local_device_count()")},
        "flax.jax_utils.prefetch_to_device": {at("prefetch_to_device")},
        "flax.training.checkpoints.restore_checkpoint": {at("restore_checkpoint")},
        "flax.jax_utils.replicate": {at("jax_utils.replicate")},
        "flax.training.common_utils.get_metrics": {at("get_metrics")},
        "sync_batch_stats": {at("state = sync_batch_stats")},
        "flax.training.checkpoints.save_checkpoint": {at("save_checkpoint")},
        "flax.jax_utils.unreplicate": {at("unreplicate")},
    }


def test_every_idiom_of_the_ensembling_howto_is_found():
    lines = found(migrate.scan_source(HOWTO, "howto.py"))
    at = functools.partial(line_of, HOWTO)
    assert lines == {
        "jax.pmap": {at("@jax.pmap")},
        "jax.lax.pmean": {at("pmean")},
        "jax.lax.axis_index": {at("axis_index")},
        "jax.lax.psum": {at("psum")},
        "flax.training.common_utils.shard_prng_key": {at("shard_prng_key")},
        "flax.training.common_utils.shard": {at("common_utils.shard(")},
        "jax.device_put_sharded": {at("device_put_sharded")},
        "jax.device_put_replicated": {at("device_put_replicated")},
        "a value scaled by the device count": {at("0.1 * jax.device_count()")},
        "flax.jax_utils.pad_shard_unpad": {at("= pad_shard_unpad")},
        "flax.jax_utils.replicate": {at("return replicate")},
    }


def test_meshkits_own_recipes_have_no_pmap_idiom(capsys):
    assert migrate.main([str(ROOT / "recipes")]) == 0
    assert capsys.readouterr().out.strip() == "none found"


def test_the_command_lists_findings_and_exits_1(tmp_path: Path, capsys):
    (tmp_path / "train.py").write_text(IMAGENET)
    assert migrate.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    line = line_of(IMAGENET, "p_train_step")
    assert f"{tmp_path / 'train.py'}:{line}: jax.pmap: jax.jit with shardings" in out
    assert "docs/pmap.md#what-replaces-what" in out and "pmap-era idiom(s) in 1 file(s)" in out
    assert migrate.main([str(tmp_path / "missing.py")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_per_device_communication_is_found():
    source = """
from jax import lax
import jax

def step(x):
    y = lax.ppermute(x, "batch", perm=[(0, 1), (1, 0)])
    z = jax.lax.all_to_all(y, "batch", 0, 0)
    return lax.all_gather(z, "batch")
"""
    at = functools.partial(line_of, source)
    assert found(migrate.scan_source(source, "ring.py")) == {
        "jax.lax.ppermute": {at("ppermute")},
        "jax.lax.all_to_all": {at("all_to_all")},
        "jax.lax.all_gather": {at("all_gather")},
    }


def test_an_expression_hundreds_of_terms_deep_is_checked_to_its_last_term(tmp_path: Path):
    """Generated code (sympy ships such tables) nests deeper than a recursive walk of
    the tree can go; the checker keeps its own stack and finds the idiom at the bottom.
    A file too deep for Python's parser itself is one line of the files not checked."""
    terms = " + ".join(f"x{i}" for i in range(900))
    source = f"import jax\nbatch = 64 * jax.device_count() + {terms}\n"
    assert found(migrate.scan_source(source, "table.py")) == {
        "a value scaled by the device count": {2}
    }
    (tmp_path / "deeper.py").write_text("y = " + " + ".join(f"x{i}" for i in range(20000)))
    unreadable: list[str] = []
    assert migrate.scan_paths([str(tmp_path)], unreadable=unreadable) == []
    assert unreadable == [
        f"{tmp_path / 'deeper.py'}: not checked, an expression nested too deeply for "
        "Python's own parser to build its tree"
    ]


def test_a_project_scan_skips_installed_packages_unless_they_are_named(tmp_path: Path):
    pmap = "import jax\nstep = jax.pmap(lambda x: x)\n"
    installed = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "pkg"
    for folder in (tmp_path, installed, tmp_path / ".nox" / "tests"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.py").write_text(pmap)
    assert {f.path for f in migrate.scan_paths([str(tmp_path)])} == {str(tmp_path / "train.py")}
    assert {f.path for f in migrate.scan_paths([str(installed)])} == {str(installed / "train.py")}


def test_unreadable_files_are_reported_in_one_line_each_and_the_scan_goes_on(
    tmp_path: Path, capsys
):
    (tmp_path / "a_train.py").write_text(IMAGENET)
    (tmp_path / "binary.py").write_bytes(b"\x00\x01\x02\xff" * 8)
    (tmp_path / "latin.py").write_bytes("x = 'caf\xe9'\n".encode("latin-1"))  # no coding line
    declared = "# -*- coding: latin-1 -*-\nimport jax\nf = jax.pmap(abs)  # caf\xe9\n"
    (tmp_path / "declared.py").write_bytes(declared.encode("latin-1"))
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert migrate.main([str(tmp_path)]) == 1  # the readable files' findings still count
    captured = capsys.readouterr()
    errors = captured.err.strip().splitlines()
    assert len(errors) == 3 and all(": not checked, not valid Python" in e for e in errors)
    assert {Path(e.split(":")[0]).name for e in errors} == {"binary.py", "latin.py", "broken.py"}
    assert f"{tmp_path / 'declared.py'}:3: jax.pmap" in captured.out  # its coding line honoured
    assert "3 file(s) not checked (above)" in captured.out
    (tmp_path / "a_train.py").unlink()
    (tmp_path / "declared.py").unlink()
    assert migrate.main([str(tmp_path)]) == 2  # nothing found, but not everything checked


WRITTEN_BY_HAND = """
import jax
import jax.numpy as jnp
from flax.training import checkpoints

def step(state, batch, dynamic_scale):
    grad_fn = dynamic_scale.value_and_grad(loss_fn, axis_name="batch")
    dynamic_scale, is_fin, loss, grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state.replace(params=jnp.where(is_fin, new_state.params, state.params))

def save(state, workdir):
    state = jax.tree_util.tree_map(lambda x: x[0], state)
    checkpoints.save_checkpoint_multiprocess(workdir, state, 10)

per_host = 128 // jax.process_count()
images = images.reshape((jax.device_count(), -1) + images.shape[1:])
labels = labels.reshape((len(jax.local_devices()), -1))
model = nn.BatchNorm(axis_name="batch")  # meshkit: ok
"""


def test_idioms_written_by_hand_are_found_and_a_handled_line_is_not(tmp_path: Path, capsys):
    found = {(f.line, f.idiom) for f in migrate.scan_source(WRITTEN_BY_HAND)}
    assert found == {
        (7, "DynamicScale.value_and_grad(axis_name=...)"),
        (10, "keeping a step only where its gradients are finite (jnp.where(is_fin, ...))"),
        (13, "an unreplicate by hand (tree_map(lambda x: x[0], ...))"),
        (14, "flax.training.checkpoints.save_checkpoint_multiprocess"),
        (16, "a per-process batch size (... // jax.process_count())"),
        (17, "a reshape to (devices, per_device, ...)"),
        (18, "a reshape to (devices, per_device, ...)"),
    }  # line 19's BatchNorm ends in "# meshkit: ok": looked at and kept
    (tmp_path / "train.py").write_text(WRITTEN_BY_HAND)
    assert migrate.main([str(tmp_path), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["findings"]) == 7 and printed["not_checked"] == []
    assert printed["findings"][0]["line"] == 7 and printed["findings"][0]["guide"]


def notebook(*cells: tuple[str, str]) -> str:
    """A Jupyter notebook's JSON with these (cell type, source) cells; sources as lists of
    lines, as Jupyter writes them."""
    return json.dumps(
        {
            "cells": [
                {"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True)}
                for kind, text in cells
            ],
            "metadata": {},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


def test_a_notebook_is_checked_cell_by_cell_with_imports_from_earlier_cells(tmp_path: Path, capsys):
    imports, _, body = HOWTO.partition("\n\n\n")
    body = "%%time\n!pip install -q flax\n" + body  # magics and shell lines are skipped
    text = notebook(("code", imports), ("markdown", "Train it with `jax.pmap`."), ("code", body))
    findings = migrate.scan_notebook(text, "howto.ipynb")
    assert {f.cell for f in findings} == {3}  # the markdown cell names pmap in prose only
    at = functools.partial(line_of, body)
    expected = found(migrate.scan_source(HOWTO, "howto.py"))
    assert found(findings) == {  # the same idioms, at their lines in the cell
        idiom: {at(HOWTO.splitlines()[line - 1]) for line in lines}
        for idiom, lines in expected.items()
    }
    (tmp_path / "howto.ipynb").write_text(text)
    checkpoints = tmp_path / ".ipynb_checkpoints"
    checkpoints.mkdir()
    (checkpoints / "howto-checkpoint.ipynb").write_text(text)  # Jupyter's autosave: skipped
    assert migrate.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'howto.ipynb'}:cell 3:{at('@jax.pmap')}: jax.pmap: jax.jit" in out
    assert f"{len(findings)} pmap-era idiom(s) in 1 file(s)." in out
    assert migrate.main(["--json", str(tmp_path / "howto.ipynb")]) == 1
    records = json.loads(capsys.readouterr().out)["findings"]
    assert {r["cell"] for r in records} == {3} and len(records) == len(findings)


def test_a_broken_cell_or_a_file_that_is_no_notebook_is_named_and_the_rest_checked(
    tmp_path: Path, capsys
):
    text = notebook(("code", "import jax\n"), ("code", "def f(:\n"), ("code", "g = jax.pmap(f)\n"))
    (tmp_path / "a.ipynb").write_text(text)
    (tmp_path / "b.ipynb").write_text("{not json")
    assert migrate.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert f"{tmp_path / 'a.ipynb'}:cell 3:1: jax.pmap" in captured.out
    assert captured.err.strip().splitlines() == [
        f"{tmp_path / 'a.ipynb'}: cell 2 not checked, not valid Python at line 1: invalid syntax",
        f"{tmp_path / 'b.ipynb'}: not checked, not a Jupyter notebook (JSONDecodeError: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ]


def test_a_folder_with_nothing_to_check_is_an_error_not_a_clean_result(tmp_path: Path, capsys):
    (tmp_path / "notes.txt").write_text("jax.pmap(f)\n")
    assert migrate.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: no Python files (*.py) or notebooks (*.ipynb) in {tmp_path}."
    )
