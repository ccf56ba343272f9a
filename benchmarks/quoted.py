"""The measured numbers the docs quote, each from one recorded run.

A table or phrase of measured numbers in README.md or docs/ sits between
``<!-- quoted: NAME -->`` and ``<!-- /quoted -->``; ``NAME`` is a renderer here that
builds it from a recorded run in ``benchmarks/quoted/<run>.json``. So the README and two
pages that quote one measurement quote the same run, and a new run changes them all:

    python -m benchmarks sweep                    # writes benchmarks/results/sweep.json
    python -m benchmarks.quoted record sweep      # the run the docs quote from now on
    python -m benchmarks.quoted                   # rewrites every quoted region

``tests/first_hour.py`` writes ``benchmarks/results/first_hour.json`` the same way.
``tests/test_docs.py`` checks that every region equals its rendering from the recorded
runs. Results in ``benchmarks/results/`` stay untracked; a recorded run is tracked.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDED = Path(__file__).resolve().parent / "quoted"
RESULTS = Path(__file__).resolve().parent / "results"

REGION = re.compile(r"(<!-- quoted: ([\w.]+) -->)(.*?)(<!-- /quoted -->)", re.DOTALL)
"""A quoted region: its opening marker, the renderer's name, the text, the closing marker."""


def recorded(run: str) -> dict[str, Any]:
    """The recorded run ``benchmarks/quoted/<run>.json``."""
    return json.loads((RECORDED / f"{run}.json").read_text())


def _seconds(value: float) -> str:
    """Wall time as a reader says it: ``41 s``, ``2 min 1 s``, ``12 min``."""
    if value < 100:
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    return f"{minutes} min" if minutes >= 10 else f"{minutes} min {seconds} s"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    rule = ["---:" if a == "right" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def first_hour_table(run: dict[str, Any]) -> str:
    """Each command of the first hour: its wall time and checked result."""
    rows = [[f"`{r['command']}`", _seconds(r["seconds"]), r["result"]] for r in run["rows"]]
    return _table(["command", "wall time", "result"], ["left", "right", "left"], rows)


def first_hour_first_command(run: dict[str, Any]) -> str:
    """``about 30 s``: the README's first recipe, as the first hour measured it."""
    row = next(r for r in run["rows"] if r["command"] == "python3 -m recipes.data_parallel")
    return f"about {5 * round(row['seconds'] / 5):.0f} s"


def first_hour_machine(run: dict[str, Any]) -> str:
    """Where and with what the first hour was measured."""
    env = run["environment"]
    return (
        f"{env['cores']} cores, {env['memory_gib']:.0f} GiB, Python {env['python']}, measured "
        f"{run['date']}"
    )


SWEEP, RESIDENT, SEQUENTIAL = (
    "sweep: run_sweep, one program",
    "sweep: resident data, auto steps per dispatch",
    "sequential: 16 fit runs",
)
_SWEEP_NAMES = {
    SWEEP: "sweep (`run_sweep`, one program)",
    RESIDENT: "sweep, resident data and `'auto'` steps per dispatch",
    SEQUENTIAL: "sequential (16 `fit` runs)",
}


Cell = Callable[[dict[str, Any]], str]
"""One column's text for one candidate of the sweep benchmark."""


_SWEEP_CELLS: dict[str, Cell] = {
    "median": lambda c: f"{c['median_s']:.1f}",
    "total": lambda c: f"{c['total_s']:.1f}",
    "ratio": lambda c: f"{c['ratio_of_totals_vs_baseline']:.3f}",
    "rate": lambda c: f"{c['member_steps_per_second']:.1f}",
    "compiles": lambda c: str(c["compiles"]),
    "step compiles": lambda c: str(max(c["train_step_compiles_per_call"])),
    "compile s": lambda c: f"{c['median_compile_seconds']:.1f}",
    "without compiles": lambda c: f"{c['median_seconds_excluding_compiles']:.1f}",
    "accuracy": lambda c: f"{c['best_test_accuracy']:.4f}",
}


def _sweep_rows(run: dict[str, Any], header: list[str], cells: list[str]) -> str:
    """One row per candidate, ``cells`` naming its columns, the sweep's ratio in bold."""
    rows = []
    for name, label in _SWEEP_NAMES.items():
        row = [_SWEEP_CELLS[cell](run["candidates"][name]) for cell in cells]
        if name == SWEEP and "ratio" in cells:
            index = cells.index("ratio")
            row[index] = f"**{row[index]}**"
        rows.append([label, *row])
    return _table(header, ["left"] + ["right"] * len(cells), rows)


def sweep_table(run: dict[str, Any]) -> str:
    """Every column of the sweep benchmark, for docs/benchmarks.md."""
    rounds = run["candidates"][SEQUENTIAL]["rounds"]
    header = [
        "candidate",
        "median s / 16 settings",
        f"total s ({rounds} calls)",
        "total / sequential",
        "member-steps/s",
        f"compiles ({rounds} calls)",
        "train step compiles per call",
        "median compile s",
        "median s without compiles",
        "best test accuracy",
    ]
    return _sweep_rows(run, header, list(_SWEEP_CELLS))


def sweep_summary(run: dict[str, Any]) -> str:
    """The sweep against sequential runs in four columns, for docs/sweeps.md."""
    header = ["", "median s", "total / sequential", "member-steps/s", "train-step compiles"]
    return _sweep_rows(run, header, ["median", "ratio", "rate", "step compiles"])


def sweep_ratio(run: dict[str, Any]) -> str:
    """``0.125``: the sweep's ratio of totals to the sequential runs."""
    return f"{run['sweep_over_sequential']:.3f}"


def sweep_ratio_without_compiles(run: dict[str, Any]) -> str:
    """The sweep's median time without compiles over the sequential runs'."""
    c = run["candidates"]
    sweep = c[SWEEP]["median_seconds_excluding_compiles"]
    return f"{sweep / c[SEQUENTIAL]['median_seconds_excluding_compiles']:.2f}"


def sweep_resident_over_sweep(run: dict[str, Any]) -> str:
    """The resident, auto-dispatched sweep's time as a multiple of the one-step sweep's."""
    c = run["candidates"]
    return f"{c[RESIDENT]['total_s'] / c[SWEEP]['total_s']:.2f}"


def _versions(env: dict[str, Any]) -> str:
    """``Python 3.11.7, jax 0.10.2, flax 0.12.8, optax 0.2.8``: a recorded run's software."""
    return f"Python {env['python']}, jax {env['jax']}, flax {env['flax']}, optax {env['optax']}"


def versions_and_devices(run: dict[str, Any]) -> str:
    """``Python 3.11.7, jax 0.10.2, ..., 8 CPU devices``: a recorded run's software and
    devices."""
    env = run["environment"]
    return f"{_versions(env)}, {env['devices']} {env['platform'].upper()} devices"


def sweep_versions(run: dict[str, Any]) -> str:
    """The software and devices of the recorded sweep run."""
    env = run["environment"]
    return f"{env['devices']} fake {env['platform'].upper()} devices; {_versions(env)}"


def _point(point: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in point.items())


def sweep_best_settings(run: dict[str, Any]) -> str:
    """Which setting each way found best, and how far the two disagree per setting."""
    sweep, sequential = run["candidates"][SWEEP], run["candidates"][SEQUENTIAL]
    examples = 360
    images = round(run["max_accuracy_difference"] * examples)
    return (
        f"the sweep's best setting is {_point(sweep['best_point'])} "
        f"({sweep['best_test_accuracy']:.4f}), the sequential runs' "
        f"{_point(sequential['best_point'])} ({sequential['best_test_accuracy']:.4f}). Per "
        f"setting the test accuracies differ by at most {run['max_accuracy_difference']:.4f} "
        f"({images} of {examples} test images)"
    )


def fit_overhead_table(run: dict[str, Any]) -> str:
    """Each case: the bare loop's and ``fit``'s median seconds (fresh processes, timed from
    outside, compiles included), ``fit`` / bare as rates from totals, what ``'auto'``
    chose, and the size it did not choose."""
    rows = []
    for case in run["cases"]:
        median, over = case["median_seconds"], case["over_bare"]
        auto = "fit, 'auto'"
        fixed = next(label for label in median if label.startswith("fit, N="))
        chose = ", ".join(str(n) for n in case["auto_chose"])
        rows.append(
            [
                case["case"],
                f"{median['bare loop']:.2f} s",
                f"{median[auto]:.2f} s",
                f"**{over[auto]:.2f}×**",
                chose,
                f"{over[fixed]:.2f}× ({fixed.removeprefix('fit, ')})",
            ]
        )
    header = ["case", "bare loop", "`fit`, `'auto'`", "`fit` / bare", "`'auto'` chose"]
    header += ["the other size / bare"]
    return _table(header, ["left"] + ["right"] * 5, rows)


def host_placement_table(run: dict[str, Any]) -> str:
    """``fit``'s host-input rate with the loop's placement and with a placing thread, at
    1 and 32 steps per dispatch, and thread / loop from totals."""
    rows = []
    for case in run["cases"]:
        rate = case["steps_per_second"]
        cells = [case["title"]]
        for n, ratio in case["thread_over_loop"].items():
            cells += [f"{rate[f'loop, N={n}']:,.0f}", f"{rate[f'thread, N={n}']:,.0f}"]
            cells.append(f"**{float(ratio):.2f}×**")
        rows.append(cells)
    header = ["case", "loop, N=1 (steps/s)", "thread, N=1", "thread / loop"]
    header += ["loop, N=32", "thread, N=32", "thread / loop"]
    return _table(header, ["left"] + ["right"] * 6, rows)


def host_placement_one_device(run: dict[str, Any]) -> str:
    """Thread / loop for the tiny MLP on one device, one step per dispatch."""
    case = next(c for c in run["cases"] if "1 device(s)" in c["title"])
    return f"{float(case['thread_over_loop']['1']):.2f}"


_ENSEMBLE_ROWS = {
    "HOWTO pmap, K=8": "the HOWTO's `pmap` program, K=8",
    "meshkit K=8, ensemble=8": "meshkit K=8, `ensemble=8`",
    "meshkit K=16, ensemble=8": "meshkit K=16, `ensemble=8` (2 members per device)",
    "meshkit K=8, ensemble=8, donate=False": "meshkit K=8, `ensemble=8`, state not donated",
    "meshkit K=8, ensemble=4,data=2": "meshkit K=8, `ensemble=4,data=2`",
    "meshkit K=8, ensemble=2,data=4": "meshkit K=8, `ensemble=2,data=4`",
}


def ensemble_table(run: dict[str, Any]) -> str:
    """The ensemble step against the HOWTO's pmap program: per step, totals, compiles."""
    rows = [
        [
            label,
            f"{run['candidates'][name]['median_s'] * 1e3:.1f}",
            f"{run['candidates'][name]['total_s']:.3f}",
            f"{run['candidates'][name]['ratio_of_totals_vs_baseline']:.3f}",
            str(run["candidates"][name]["compiles"]),
        ]
        for name, label in _ENSEMBLE_ROWS.items()
    ]
    header = ["candidate", "median ms/step", "total s", "total / pmap", "compiles"]
    return _table(header, ["left", "right", "right", "right", "right"], rows)


def _times(count: int) -> str:
    """``once``, ``twice``, ``3 times``."""
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def ensemble_summary(run: dict[str, Any]) -> str:
    """The ratios the ensemble table says, in one sentence."""
    return (
        f"meshkit K=8 / pmap: median {run['median_ratio_meshkit_k8_over_pmap']:.3f}, ratio "
        f"of totals {run['total_ratio_meshkit_k8_over_pmap']:.3f}; time per member-step, "
        f"K=16 / K=8: median {run['median_per_member_ratio_k16_over_k8']:.3f}, ratio of "
        f"totals {run['total_per_member_ratio_k16_over_k8']:.3f}; a whole `fit` run "
        f"({run['whole_run']['steps']} steps and a full evaluation) compiles the ensemble "
        f"step {_times(run['whole_run']['train_step_compiles'])}. "
        f"{_versions(run['environment'])}, {run['environment']['devices']} "
        f"{run['environment']['platform'].upper()} devices"
    )


_STRATEGY_ROWS = (
    ("K=8", "one member", "one member alone"),
    ("K=8", "K=8 jit(vmap)", "K=8, hand-written `jit(vmap)`"),
    ("K=8", "K=8 loop", 'K=8, meshkit `strategy="loop"` (the CPU default)'),
    ("K=8", "K=8 vmap", 'K=8, meshkit `strategy="vmap"`'),
    ("K=32", "K=32 loop", 'K=32, meshkit `"loop"`'),
    ("K=32", "K=32 vmap", 'K=32, meshkit `"vmap"`'),
)


def ensemble_strategies_table(run: dict[str, Any]) -> str:
    """K members on one device with each member strategy: per step, against a
    hand-written ``jit(vmap)`` (totals, K=8), and compile seconds."""
    rows = []
    for group, name, label in _STRATEGY_ROWS:
        table = run["one_device"][group]
        row = table["candidates"][name]
        ratio = f"{row['ratio_of_totals_vs_baseline']:.2f}" if group == "K=8" else ""
        rows.append(
            [
                label,
                f"{row['median_s'] * 1e3:,.1f}",
                ratio,
                f"{table['compile_seconds'][name]:.1f}",
            ]
        )
    header = ["candidate", "median ms/step", "vs `jit(vmap)` (totals)", "compile s"]
    return _table(header, ["left", "right", "right", "right"], rows)


def ensemble_strategies_summary(run: dict[str, Any]) -> str:
    """What the one-device strategy table says, in one sentence."""
    k8, k32 = run["one_device"]["K=8"], run["one_device"]["K=32"]
    loop8 = k8["candidates"]["K=8 loop"]
    loop32, vmap32 = k32["candidates"]["K=32 loop"], k32["candidates"]["K=32 vmap"]
    return (
        f"the loop is {1 / loop8['ratio_of_totals_vs_baseline']:.1f}× faster than "
        f"`jit(vmap)` at K=8 and {vmap32['median_s'] / loop32['median_s']:.1f}× faster "
        f"than the `vmap` strategy at K=32 ({loop32['median_s'] / 32 * 1e3:.1f} ms per "
        f"member-step against {loop8['median_s'] / 8 * 1e3:.1f} at K=8); it compiles in "
        f"{k8['compile_seconds']['K=8 loop']:.1f} s at K=8 and "
        f"{k32['compile_seconds']['K=32 loop']:.1f} s at K=32, against "
        f"{k8['compile_seconds']['K=8 vmap']:.1f} and "
        f"{k32['compile_seconds']['K=32 vmap']:.1f} s for `vmap`"
    )


_PRECISION_ROWS = {
    "f32": "f32",
    "bf16": "bf16",
    "f16 + loss scaling": "f16 + loss scaling",
    "f32, 4 micro-batches, unrolled": "f32, 4 micro-batches, unrolled (CPU's default)",
    "f32, 4 micro-batches, one loop": "f32, 4 micro-batches, one loop (GPU's and TPU's)",
    "f32, 8 micro-batches, unrolled": "f32, 8 micro-batches, unrolled",
    "f32, 8 micro-batches, one loop": "f32, 8 micro-batches, one loop",
}


def _temp_over_f32(run: dict[str, Any], name: str) -> float:
    return run["memory"][name]["temp_bytes"] / run["memory"]["f32"]["temp_bytes"]


def precision_table(run: dict[str, Any]) -> str:
    """Each precision and micro-batch form: step time, and XLA's temporaries against f32
    (in bold where a loop holds one micro-batch's activations at a time)."""
    rows = []
    for name, label in _PRECISION_ROWS.items():
        timing, temp = run["candidates"][name], run["memory"][name]["temp_bytes"]
        ratio = f"{_temp_over_f32(run, name):.3f}"
        rows.append(
            [
                label,
                f"{timing['median_s'] * 1e3:.1f}",
                f"{timing['ratio_of_totals_vs_baseline']:.3f}",
                f"{temp / 2**20:.2f}",
                f"**{ratio}**" if "one loop" in name else ratio,
            ]
        )
    header = ["candidate", "median ms/step", "total / f32", "temporaries MiB", "temp / f32"]
    return _table(header, ["left", "right", "right", "right", "right"], rows)


def precision_arguments(run: dict[str, Any]) -> str:
    """``3.34 MiB``: the state and batch a step takes, the same for every candidate."""
    return f"{run['memory']['f32']['argument_bytes'] / 2**20:.2f} MiB"


def precision_loop_temporaries(run: dict[str, Any]) -> str:
    """What micro-batches in one loop save in temporaries, with 4 and with 8."""
    four = _temp_over_f32(run, "f32, 4 micro-batches, one loop")
    eight = _temp_over_f32(run, "f32, 8 micro-batches, one loop")
    return f"{four:.2f}× the temporaries with 4, {eight:.2f}× with 8"


def precision_loop_slowdown(run: dict[str, Any]) -> str:
    """How much slower 4 micro-batches run as one loop than unrolled (XLA:CPU's loop
    body), and the unrolled form's time against one f32 step."""
    candidates = run["candidates"]
    loop = candidates["f32, 4 micro-batches, one loop"]["total_s"]
    unrolled = candidates["f32, 4 micro-batches, unrolled"]
    return (
        f"{loop / unrolled['total_s']:.1f}× slower in the recorded run, while 4 unrolled "
        f"take {unrolled['ratio_of_totals_vs_baseline']:.2f}× one f32 step"
    )


def _sizes(run: dict[str, Any]) -> list[str]:
    """The image sets of an input-pipeline run, in the order measured."""
    return [key for key, value in run.items() if isinstance(value, dict) and "candidates" in value]


def _size_label(size: str) -> str:
    """``32×32``, ``256×256 → 224``."""
    return size.replace("x", "×").replace("->", "→")


def _images(rate: float, limit: float) -> str:
    return f"{rate:,.0f} ({rate / limit:.2f}×)"


def input_pipeline_table(run: dict[str, Any]) -> str:
    """Images per second of every host setting and of decode-only input, per image
    size, against the limit; the host default (``input_settings``) in bold, and the
    fastest host setting named."""
    columns: list[str] = []
    for size in _sizes(run):
        for name in run[size]["candidates"]:
            base = name.split(" = ")[0]
            if not base.startswith("members=") and base not in columns:
                columns.append(base)
    rows = []
    for size in _sizes(run):
        measured, limit = run[size], run[size]["limit_images_per_second"]
        by_base = {name.split(" = ")[0]: name for name in measured["candidates"]}
        cells = [_size_label(size), f"{limit:,.0f}"]
        for base in columns:
            name = by_base.get(base)
            if name is None:
                cells.append("")
                continue
            cell = _images(measured["candidates"][name]["images_per_s"], limit)
            cells.append(f"**{cell}**" if name == measured["host_default_row"] else cell)
        fastest = measured["fastest_host_setting"].split(" = ")[0]
        same = measured["fastest_host_setting"] == measured["host_default_row"]
        cells.append(f"{fastest}{' (the default)' if same else ''}")
        rows.append(cells)
    header = [
        "JPEG, trained size",
        f"limit ({run['cores']} cores)",
        *columns,
        "fastest host setting",
    ]
    return _table(header, ["left", *["right"] * (len(header) - 2), "left"], rows)


def input_pipeline_defaults(run: dict[str, Any]) -> str:
    """The host default and the recipe's default per image size, as shares of the limit."""
    rows = []
    for size in _sizes(run):
        measured = run[size]
        limit = measured["limit_images_per_second"]
        host = measured["host_default_images_per_second"] / limit
        default = measured["default_images_per_second"] / limit
        if measured["default_augmentation"] == "device":
            how = (
                f"decode only; device augmentation "
                f"{measured['device_augment_ms_per_batch']:.1f} ms a batch"
            )
        else:
            settings = measured["default_settings"]
            how = "threads on the host" if settings["num_threads"] else "workers on the host"
        rows.append([_size_label(size), f"{host:.2f}×", f"{default:.2f}× ({how})"])
    header = ["images", "host default (`input_settings`)", "recipe default"]
    return _table(header, ["left", "right", "right"], rows)


def input_pipeline_limits(run: dict[str, Any]) -> str:
    """``limit 10,949, 8,761 and 1,064 images/s at 32×32, 64×64 and 256→224``."""
    sizes = _sizes(run)
    rates = [f"{run[size]['limit_images_per_second']:,.0f}" for size in sizes]
    labels = [_size_label(size).replace(" ", "") for size in sizes]
    return (
        f"limit {', '.join(rates[:-1])} and {rates[-1]} images/s at "
        f"{', '.join(labels[:-1])} and {labels[-1]}"
    )


def input_pipeline_step(run: dict[str, Any]) -> str:
    """What the image recipe's ResNet-18 step consumes."""
    step = run["resnet18_step"]
    return (
        f"{step['images_per_s']:,.0f} images/s ({step['median_s'] * 1e3:.0f} ms for "
        f"{run['batch']} images at 32×32 on 8 fake CPU devices)"
    )


def input_pipeline_device_augmentation(run: dict[str, Any]) -> str:
    """The train step's share of decode-only input, per image size."""
    parts = [
        f"{run[size]['device_augment_ms_per_batch']:.1f} ms ({_size_label(size)})"
        for size in _sizes(run)
    ]
    return f"{', '.join(parts[:-1])} and {parts[-1]} a batch of {run['batch']}"


def input_pipeline_default_is_fastest(run: dict[str, Any]) -> str:
    """Whether the host default was the fastest host setting at every size, and where not."""
    missed = []
    for size in _sizes(run):
        measured = run[size]
        fastest, default = measured["fastest_host_setting"], measured["host_default_row"]
        if fastest != default:
            rows = measured["candidates"]
            missed.append(
                f"at {_size_label(size)} {fastest} was ({rows[fastest]['ratio_to_limit']:.2f}× "
                f"against {rows[default]['ratio_to_limit']:.2f}×)"
            )
    if not missed:
        return "the default is the fastest host setting at every size"
    return f"the default is not the fastest everywhere: {'; '.join(missed)}"


def input_pipeline_members(run: dict[str, Any]) -> str:
    """Images delivered by K member orders at once, per small image size."""
    parts, counts = [], ""
    for size in _sizes(run):
        measured, limit = run[size], run[size]["limit_images_per_second"]
        members = {n: c for n, c in measured["candidates"].items() if n.startswith("members=")}
        if not members:
            continue
        counts = " and ".join(name.split("=")[1] for name in members)
        rates = " and ".join(_images(c["images_per_s"], limit) for c in members.values())
        parts.append(f"{rates} images/s at {_size_label(size)}")
    return f"{counts} members deliver {'; '.join(parts)}"


_LBFGS_SOLVERS = {
    "notebook jaxopt loop (ported)": "the notebook's loop, ported",
    "jaxopt.LBFGS.run, jitted": "`jaxopt.LBFGS.run`, jitted",
    "optax.lbfgs, jitted loop": "`optax.lbfgs`, jitted loop",
    "meshkit.lbfgs solve": "`meshkit.lbfgs` `solve` (defaults)",
    "meshkit, history_size=10": "`meshkit.lbfgs`, `history_size=10`",
}
_LBFGS_PEERS = (
    "notebook jaxopt loop (ported)",
    "jaxopt.LBFGS.run, jitted",
    "optax.lbfgs, jitted loop",
)
_LBFGS_PROBLEMS = {"seed": "the notebook's problem", "ill_conditioned": "the ill-conditioned one"}


def _lbfgs_table(problem: dict[str, Any]) -> str:
    """Each solver's iterations, evaluations, cost per evaluation and meshkit's time
    over its time (bold where meshkit is faster)."""
    rows = []
    for name, label in _LBFGS_SOLVERS.items():
        row = problem["candidates"].get(name)
        if row is None:
            continue
        ratio = row["meshkit_total_over_this"]
        mark = " ¹" if "jaxopt" in name else ""
        rows.append(
            [
                label,
                str(row["iterations"]),
                f"{row['evaluations']}{mark}",
                f"{row['ms_per_evaluation']:.1f}",
                f"{row['evaluation_over_one_read']:.2f}",
                f"**{ratio:.3f}**" if ratio < 1 and name in _LBFGS_PEERS else f"{ratio:.3f}",
            ]
        )
    header = [
        "solver",
        "iterations",
        "evaluations",
        "ms / evaluation",
        "× one read of X",
        "meshkit / this",
    ]
    return _table(header, ["left", *["right"] * 5], rows)


def _lbfgs_read(problem: dict[str, Any], rows: int | None = None) -> str:
    """``one read of X: 6.0 ms`` (with its size and rate for the large problem)."""
    read = problem["one_read_of_x_ms"]
    if rows is None:
        return f"one read of X: {read:.1f} ms"
    megabytes = rows * 784 * 4 / 1e6
    return (
        f"one read of X, {megabytes:,.0f} MB: {read:.1f} ms, "
        f"{problem['bandwidth_gb_per_s']:.1f} GB/s"
    )


def _lbfgs_peer_ratios(problem: dict[str, Any]) -> list[float]:
    return [
        problem["candidates"][name]["meshkit_total_over_this"]
        for name in _LBFGS_PEERS
        if name in problem["candidates"]
    ]


def lbfgs_ratios(run: dict[str, Any]) -> str:
    """meshkit's time over each peer's, per problem, in the peers' order."""
    parts = []
    for key, label in (*_LBFGS_PROBLEMS.items(), ("large", "at 200,000 rows")):
        ratios = ", ".join(f"{r:.2f}" for r in _lbfgs_peer_ratios(run["problems"][key]))
        parts.append(f"{ratios} {'on ' if key in _LBFGS_PROBLEMS else ''}{label}")
    return "; ".join(parts)


def lbfgs_summary(run: dict[str, Any]) -> str:
    """meshkit's time against the fastest and the slowest peer, per problem."""
    spans = []
    for key in ("seed", "ill_conditioned", "large"):
        ratios = _lbfgs_peer_ratios(run["problems"][key])
        spans.append(f"{min(ratios):.2f}–{max(ratios):.2f}×")
    return (
        f"meshkit takes {spans[0]} the peers' times on the notebook's problem, {spans[1]} "
        f"on the ill-conditioned one and {spans[2]} at 200,000 rows"
    )


def lbfgs_reads(run: dict[str, Any]) -> str:
    """``2.5–3.0 reads of X``: what one of meshkit's evaluations costs, over the problems."""
    reads = [
        problem["candidates"]["meshkit.lbfgs solve"]["evaluation_over_one_read"]
        for problem in run["problems"].values()
    ]
    return f"{min(reads):.1f}–{max(reads):.1f} reads of X"


def lbfgs_exactness(run: dict[str, Any]) -> str:
    """The final objective against scipy's float64 optimum."""
    meshkit = run["problems"]["seed"]["candidates"]["meshkit.lbfgs solve"]["value"]
    return (
        f"the final objective, {meshkit:.7f}, is {run['relative_gap_to_scipy']:.1e} "
        f"(relative) above scipy's float64 L-BFGS-B optimum, {run['scipy']['value']:.7f}"
    )


def lbfgs_operations(run: dict[str, Any]) -> str:
    """Operations per iteration of one compiled step."""
    ops = run["operations_per_iteration"]
    return f"{ops['fixed']} outside the line search, {ops['per_trip_0']} per line-search evaluation"


def lbfgs_scaling(run: dict[str, Any]) -> str:
    """Time per iteration at three sizes."""
    rows = [
        [
            f"{int(size):,}",
            f"{row['ms_per_iteration']:.1f}",
            f"{row['ms_per_evaluation']:.1f}",
            f"{row['evaluations'] / row['iterations']:.2f}",
        ]
        for size, row in run["scaling"].items()
    ]
    header = ["rows", "ms / iteration", "ms / evaluation", "evaluations / iteration"]
    return _table(header, ["right"] * 4, rows)


def lbfgs_peak_memory(run: dict[str, Any]) -> str:
    """Peak resident memory of one first solve, the notebook's loop against meshkit."""
    seed, meshkit = run["peak_memory"]["seed"], run["peak_memory"]["meshkit"]

    def peak(row: dict[str, Any]) -> str:
        return (
            f"{row['peak_mib']:.0f} MiB (+{row['growth_mib']:.0f} MiB over "
            f"{row['before_mib']:.0f} MiB)"
        )

    return f"the notebook's loop peaks at {peak(seed)}, meshkit at {peak(meshkit)}"


RENDERERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "first_hour.table": ("first_hour", first_hour_table),
    "first_hour.first_command": ("first_hour", first_hour_first_command),
    "first_hour.machine": ("first_hour", first_hour_machine),
    "sweep.table": ("sweep", sweep_table),
    "sweep.summary": ("sweep", sweep_summary),
    "sweep.ratio": ("sweep", sweep_ratio),
    "sweep.ratio_without_compiles": ("sweep", sweep_ratio_without_compiles),
    "sweep.resident_over_sweep": ("sweep", sweep_resident_over_sweep),
    "sweep.versions": ("sweep", sweep_versions),
    "sweep.best_settings": ("sweep", sweep_best_settings),
    "fit_overhead.table": ("fit_overhead", fit_overhead_table),
    "fit_overhead.versions": (
        "fit_overhead",
        lambda run: f"{_versions(run['environment'])}, {run['environment']['platform'].upper()}",
    ),
    "host_placement.table": ("host_placement", host_placement_table),
    "ensemble.table": ("ensemble", ensemble_table),
    "ensemble.summary": ("ensemble", ensemble_summary),
    "ensemble.strategies_table": ("ensemble", ensemble_strategies_table),
    "ensemble.strategies_summary": ("ensemble", ensemble_strategies_summary),
    "host_placement.one_device": ("host_placement", host_placement_one_device),
    "host_placement.versions": ("host_placement", versions_and_devices),
    "precision.table": ("precision", precision_table),
    "precision.arguments": ("precision", precision_arguments),
    "precision.loop_temporaries": ("precision", precision_loop_temporaries),
    "precision.loop_slowdown": ("precision", precision_loop_slowdown),
    "precision.versions": ("precision", versions_and_devices),
    "input_pipeline.table": ("input_pipeline", input_pipeline_table),
    "input_pipeline.defaults": ("input_pipeline", input_pipeline_defaults),
    "input_pipeline.limits": ("input_pipeline", input_pipeline_limits),
    "input_pipeline.step": ("input_pipeline", input_pipeline_step),
    "input_pipeline.device_augmentation": ("input_pipeline", input_pipeline_device_augmentation),
    "input_pipeline.members": ("input_pipeline", input_pipeline_members),
    "input_pipeline.default_is_fastest": ("input_pipeline", input_pipeline_default_is_fastest),
    "input_pipeline.versions": ("input_pipeline", versions_and_devices),
    "lbfgs.seed_table": ("lbfgs", lambda run: _lbfgs_table(run["problems"]["seed"])),
    "lbfgs.ill_conditioned_table": (
        "lbfgs",
        lambda run: _lbfgs_table(run["problems"]["ill_conditioned"]),
    ),
    "lbfgs.large_table": ("lbfgs", lambda run: _lbfgs_table(run["problems"]["large"])),
    "lbfgs.seed_read": ("lbfgs", lambda run: _lbfgs_read(run["problems"]["seed"])),
    "lbfgs.ill_conditioned_read": (
        "lbfgs",
        lambda run: _lbfgs_read(run["problems"]["ill_conditioned"]),
    ),
    "lbfgs.large_read": ("lbfgs", lambda run: _lbfgs_read(run["problems"]["large"], 200_000)),
    "lbfgs.ratios": ("lbfgs", lbfgs_ratios),
    "lbfgs.summary": ("lbfgs", lbfgs_summary),
    "lbfgs.reads": ("lbfgs", lbfgs_reads),
    "lbfgs.exactness": ("lbfgs", lbfgs_exactness),
    "lbfgs.operations": ("lbfgs", lbfgs_operations),
    "lbfgs.scaling": ("lbfgs", lbfgs_scaling),
    "lbfgs.peak_memory": ("lbfgs", lbfgs_peak_memory),
    "lbfgs.versions": ("lbfgs", versions_and_devices),
}
"""Region name -> (the recorded run it reads, the function that renders it)."""


def render(name: str) -> str:
    """Region ``name``'s text from its recorded run."""
    if name not in RENDERERS:
        raise KeyError(f"no renderer named {name!r}; the renderers are {sorted(RENDERERS)}")
    run, renderer = RENDERERS[name]
    return renderer(recorded(run))


def rendered(text: str) -> str:
    """``text`` with every quoted region rendered afresh (a block region keeps its
    blank lines around the rendering, an inline one stays inline)."""

    def one(match: re.Match[str]) -> str:
        opening, name, body, closing = match.groups()
        new = render(name)
        if body.startswith("\n"):  # a block: the markers on lines of their own
            new = f"\n{new}\n"
        return f"{opening}{new}{closing}"

    return REGION.sub(one, text)


def quoting_files() -> list[Path]:
    """README.md and every docs page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        for run in argv[1:]:
            RECORDED.mkdir(exist_ok=True)
            shutil.copyfile(RESULTS / f"{run}.json", RECORDED / f"{run}.json")
            print(f"recorded benchmarks/results/{run}.json as benchmarks/quoted/{run}.json")
        argv = []
    if argv:
        print("usage: python -m benchmarks.quoted [record RUN ...]", file=sys.stderr)
        return 2
    for path in quoting_files():
        text = path.read_text()
        new = rendered(text)
        if new != text:
            path.write_text(new)
            print(f"rewrote the quoted regions of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
