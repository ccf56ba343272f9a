"""Recipes give the same results as 1 process × 8 devices and as 2 processes × 4 devices.

Here only the recipe no other test runs on two processes; the others are compared
across layouts in their own tests (``data_parallel`` in test_train_processes,
``ensemble`` in test_ensemble_processes, ``lbfgs`` in test_lbfgs_processes,
``sharding_demo`` in test_recipes), and ``nox -s layouts`` runs all five through
``tests/layout_equivalence.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from layout_equivalence import compare, mismatches

pytestmark = pytest.mark.multiprocess


def test_full_eval_recipe_agrees_on_one_and_two_processes(tmp_path: Path):
    values, _, wrong = compare("full_eval", tmp_path)
    assert not wrong, wrong
    assert values["1x8"].keys() == values["2x4"].keys()
    # The recipe's own result, the same table on both layouts, compiles included (its
    # count leaves out the gathers that bring results to the host on two processes):
    # which methods count every example.
    summary = json.loads((tmp_path / "full_eval" / "1x8" / "summary.json").read_text())
    two = json.loads((tmp_path / "full_eval" / "2x4" / "summary.json").read_text())
    assert {k: v["compiles"] for k, v in two.items()} == {
        k: v["compiles"] for k, v in summary.items()
    }
    simple = summary["simple batching, keep remainder"]
    assert (simple["examples"], simple["compiles"]) == (360, 2)
    assert summary["drop_remainder"]["examples"] == 320
    for exact in ("meshkit.evaluate.pad_shard_unpad", "meshkit.evaluate.full_eval"):
        assert summary[exact]["examples"] == 360 and summary[exact]["compiles"] == 1
        assert summary[exact]["accuracy"] == simple["accuracy"]


def test_a_difference_is_reported():
    a = {"loss": 1.0, "test_accuracy": 0.5, "test_examples": 360.0}
    assert mismatches(a, dict(a)) == []
    assert mismatches(a, {**a, "loss": 1.001}) == ["loss: 1.0 vs 1.001"]
    assert mismatches(a, {**a, "test_accuracy": 0.5 + 1 / 360}) == []  # one digit
    assert mismatches(a, {**a, "test_accuracy": 0.51}) == ["test_accuracy: 0.5 vs 0.51"]
    assert mismatches(a, {**a, "test_examples": 359.0}) == ["test_examples: 360.0 vs 359.0"]
    assert mismatches(a, {"loss": 1.0}) == ["different keys: ['test_accuracy', 'test_examples']"]
