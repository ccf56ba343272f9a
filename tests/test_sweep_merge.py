"""``meshkit.sweep`` merge: several sweeps' trials ranked as one table, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshkit.sweep.__main__ import main
from meshkit.sweep._merge import merge_results, merged_table

pytestmark = pytest.mark.once


def write(folder: Path, points: list[float], scores: list[float | None], **extra: object) -> Path:
    trials = [
        {
            "trial": i,
            "status": "finished" if score is not None else "stopped",
            "score": score,
            "hyperparameters": {"learning_rate": rate},
            "metrics": {},
        }
        for i, (rate, score) in enumerate(zip(points, scores, strict=True))
    ]
    folder.mkdir(parents=True)
    results = {"metric": "loss", "mode": "min", "interrupted": False, "trials": trials, **extra}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_trials_of_every_slice_are_ranked_together(tmp_path: Path):
    a = write(tmp_path / "slice_0", [0.1, 0.3], [0.5, None])
    b = write(tmp_path / "slice_1", [0.2, 0.4], [0.2, 0.9])
    merged = merge_results([a, b / "results.json"])
    order = [(t["source"], t["hyperparameters"]["learning_rate"]) for t in merged["trials"]]
    # mode "min": lower is better; the unfinished trial comes last whatever its score
    assert order == [("slice_1", 0.2), ("slice_0", 0.1), ("slice_1", 0.4), ("slice_0", 0.3)]
    assert [t["rank"] for t in merged["trials"]] == [1, 2, 3, 4]
    lines = merged_table(merged).splitlines()
    assert lines[0].split() == ["rank", "source", "trial", "status", "loss", "learning_rate"]
    assert lines[1].split() == ["1", "slice_1", "0", "finished", "0.2000", "0.2"]
    assert lines[4].split() == ["4", "slice_0", "1", "stopped", "nan", "0.3"]


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"points": [0.1], "extra": {}}, 'the point {"learning_rate": 0.1} is in both slice_0'),
        ({"points": [0.2], "extra": {"mode": "max"}}, "slice_1 ranks by mode 'max' but slice_0"),
        ({"points": [0.2], "extra": {"interrupted": True, "step": 7}}, "interrupted at step 7"),
    ],
)
def test_slices_that_do_not_belong_together_are_refused(tmp_path: Path, second, message):
    a = write(tmp_path / "slice_0", [0.1], [0.5])
    b = write(tmp_path / "slice_1", second["points"], [0.4], **second["extra"])
    with pytest.raises(ValueError) as raised:
        merge_results([a, b])
    assert message in str(raised.value)


def test_the_command_prints_the_table_and_writes_the_json(tmp_path: Path, capsys):
    a = write(tmp_path / "slice_0", [0.1], [0.5])
    b = write(tmp_path / "slice_1", [0.2], [0.4])
    out = tmp_path / "merged.json"
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"2 trials from 2 sweeps; written to {out}" in printed
    assert json.loads(out.read_text())["sources"] == ["slice_0", "slice_1"]
    assert main(["merge", str(tmp_path / "missing")]) == 2
    assert "missing does not exist: expected a sweep's workdir" in capsys.readouterr().err
