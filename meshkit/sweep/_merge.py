"""Several sweeps' results ranked as one: the slices of a SLURM job array, for example.

A sweep too big for one program (or one allocation) runs as several, each over one
slice of the points (the sweep recipe's ``--slice I/N``, one per array task). Each
writes its ``results.json``; ``merge_results`` reads them, checks that they belong
together (the same metric and direction, the same hyperparameter names, no point
twice, every slice finished) and ranks all trials as ``SweepResult.ranked`` would.
``python -m meshkit.sweep merge DIR...`` prints the table and writes the merged JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshkit._paths import PathLike, as_path
from meshkit.sweep._results import format_table, rank_key


def _read(path: PathLike) -> tuple[str, dict[str, Any]]:
    location = as_path(path)
    file = location / "results.json" if location.is_dir() else location
    if not file.exists():
        raise FileNotFoundError(
            f"{file} does not exist: expected a sweep's workdir (holding results.json) or "
            "its results.json; a sweep writes it when it ends"
        )
    name = file.parent.name if file.name == "results.json" else file.stem
    return name, json.loads(file.read_text())


def merge_results(paths: Sequence[PathLike]) -> dict[str, Any]:
    """The trials of several sweeps, ranked together, each with its ``source``.

    Args:
      paths: sweep workdirs or their ``results.json`` files.

    Returns:
      ``{"metric", "mode", "sources", "trials"}``: the trials best first (finished ones
      by score, then the others), each as in ``results.json`` plus ``source`` (the
      workdir's name) and ``rank``.

    Raises:
      ValueError: when the sweeps measured different metrics or directions, named
        different hyperparameters, share a point, or one was interrupted.

    Examples:
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> root = Path(tempfile.mkdtemp())
        >>> for name, rates, scores in (("a", [0.1, 0.3], [0.5, 0.9]), ("b", [0.2], [0.7])):
        ...     trials = [{"trial": i, "status": "finished", "score": s,
        ...                "hyperparameters": {"learning_rate": r}}
        ...               for i, (r, s) in enumerate(zip(rates, scores))]
        ...     (root / name).mkdir()
        ...     results = {"metric": "accuracy", "mode": "max", "trials": trials}
        ...     _ = (root / name / "results.json").write_text(json.dumps(results))
        >>> merged = merge_results([root / "a", root / "b"])
        >>> [(t["source"], t["hyperparameters"]["learning_rate"]) for t in merged["trials"]]
        [('a', 0.3), ('b', 0.2), ('a', 0.1)]
    """
    if not paths:
        raise ValueError("no sweeps to merge: give at least one workdir or results.json")
    read = [_read(path) for path in paths]
    first_name, first = read[0]
    names: dict[str, str] = {}
    seen: dict[str, str] = {}
    trials: list[dict[str, Any]] = []
    for order, (name, results) in enumerate(read):
        for field in ("metric", "mode"):
            if results[field] != first[field]:
                raise ValueError(
                    f"{name} ranks by {field} {results[field]!r} but {first_name} by "
                    f"{first[field]!r}: only sweeps scored alike can be merged"
                )
        if results.get("interrupted"):
            raise ValueError(
                f"{name} was interrupted at step {results.get('step')}: run it again with the "
                "same arguments (it resumes and finishes), then merge"
            )
        for trial in results["trials"]:
            point = trial["hyperparameters"]
            keys = ",".join(sorted(point))
            if names.setdefault("keys", keys) != keys:
                raise ValueError(
                    f"{name} sweeps {keys} but the sweeps before it swept {names['keys']}"
                )
            text = json.dumps(point, sort_keys=True)
            if trial.get("parent") is None and text in seen and seen[text] != name:
                raise ValueError(
                    f"the point {text} is in both {seen[text]} and {name}: the slices overlap; "
                    "give each run its own --slice I/N of the same N"
                )
            seen.setdefault(text, name)
            trials.append({**trial, "source": name, "_order": order})
    ranked = sorted(
        trials,
        key=lambda t: (
            *rank_key(t["status"], t["score"], first["mode"]),
            t["_order"],
            t["trial"],
        ),
    )
    for rank, trial in enumerate(ranked, 1):
        del trial["_order"]
        trial["rank"] = rank
    return {
        "metric": first["metric"],
        "mode": first["mode"],
        "sources": [name for name, _ in read],
        "trials": ranked,
    }


def merged_table(merged: dict[str, Any], limit: int | None = None) -> str:
    """A text table of ``merge_results``'s trials, best first, naming each one's source."""
    rows = merged["trials"][:limit]
    names = list(rows[0]["hyperparameters"]) if rows else []
    header = ["rank", "source", "trial", "status", merged["metric"], *names]
    body = [
        [
            str(t["rank"]),
            t["source"],
            str(t["trial"]),
            t["status"],
            "nan" if t["score"] is None else f"{float(t['score']):.4f}",
            *(f"{t['hyperparameters'][n]:.4g}" for n in names),
        ]
        for t in rows
    ]
    return format_table(header, body, left=(1, 3))


def write_merged(merged: dict[str, Any], path: PathLike) -> Path:
    """Writes ``merged`` as JSON to ``path`` (a local path); returns it."""
    target = Path(str(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(merged, indent=1) + "\n")
    return target
