"""A plan as a printed table, a JSON file and a PNG of bytes per device."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

GiB = 2**30

Plan = Any
"""A ``meshkit.plan.Plan`` (named here without importing it: the plan imports this module)."""


GPU_CAVEAT = (
    "XLA:GPU without a GPU: memory as XLA:GPU assigns it, collectives from its program, "
    "FLOPs counted from its products (no cost analysis without a GPU; docs/planning.md)"
)


def plan_table(plan: Plan) -> str:
    """One line per layout, fitting ones first and fastest first; bytes in GiB per device.
    A layout the compiler gave no program for shows dashes for the figures only a
    program gives, and a line under the table saying why."""
    chip = plan.target.chip
    header = (
        f"{plan.target.devices} x {chip.description} ({plan.target.slices} slice(s)), "
        f"{plan.reports[0].capacity_bytes / GiB:.2f} GiB usable per chip "
        f"({plan.target.usable_bytes()[1]}); "
        f"figures from {plan.reports[0].measurement.compiler}"
    )
    width = max(len("layout"), *(len(report.layout.name) for report in plan.reports))
    reports = plan.reports
    byte, per_byte = unit_for([r.measurement.total_bytes for r in reports], BYTE_UNITS)
    # Traffic in the memory columns' binary units too, each column its own scale.
    comm, per_comm = unit_for([r.collective_bytes() for r in reports], BYTE_UNITS)
    flop, per_flop = unit_for([r.measurement.flops for r in reports], FLOP_UNITS)
    time, per_time = unit_for([r.estimated_step_seconds for r in reports], TIME_UNITS)
    columns = (
        f"{'#':>2}  {'layout':<{width}} {'fits':<4} {f'param {byte}':>9} {f'optim {byte}':>9} "
        f"{f'temp {byte}':>9} {f'total {byte}':>9} {f'comm {comm}':>8} {flop:>7} "
        f"{f'step {time}':>8} {'range':>13} {'MFU':>5} {'HFU':>5}  bound by"
    )
    rates = f"step times: {plan.target.step_efficiency().describe()} (docs/planning.md)"
    lines = [header, rates, columns, "-" * len(columns)]
    if plan.target.compiler == "gpu":  # where the figures come from, on XLA:GPU
        lines.insert(1, GPU_CAVEAT)
    notes = []
    for rank, report in enumerate(plan.reports, 1):
        m = report.measurement
        compiled = not m.error
        lines.append(
            f"{rank:>2}  {m.layout.name:<{width}} {'yes' if report.fits else 'NO':<4} "
            f"{m.params_bytes / per_byte:>9.2f} {m.optimizer_bytes / per_byte:>9.2f} "
            f"{m.temp_bytes / per_byte:>9.2f} {m.total_bytes / per_byte:>9.2f} "
            f"{_figure(report.collective_bytes() / per_comm, '9.2f', compiled)} "
            f"{_figure(m.flops / per_flop, '7.1f', compiled)} "
            f"{_figure(report.estimated_step_seconds / per_time, '8.3f', compiled)} "
            f"{_span(report.step_seconds_range, per_time, compiled)} "
            f"{_figure(report.estimated_mfu, '5.0%', compiled)} "
            f"{_figure(report.estimated_hfu, '5.0%', compiled)}  "
            f"{report.bottleneck}"
        )
        if m.error:
            notes.append(f"  ^ row {rank}, {m.layout.name}: {m.error}")
        if m.idle_axes:
            notes.append(f"  ^ row {rank}, {m.layout.name}: {_idle(m)}")
    if plan.dropped:
        notes.append(
            f"left out: {', '.join(plan.dropped)}: a model axis that shards no parameter, so "
            "its devices would repeat the same work (keep_idle=True, or --keep-idle, lists them)"
        )
    return "\n".join(lines + notes)


BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
FLOP_UNITS = (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3))
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def unit_for(values: list[float], units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest of ``units`` in which the largest of ``values`` is at least 0.1 (the
    smallest unit when none is), so that small models print figures, not zeros.

    Examples:
        >>> unit_for([3.2 * 2**30, 0.5 * 2**30], BYTE_UNITS)
        ('GiB', 1073741824)
        >>> unit_for([1.26e-05, 1.24e-05], TIME_UNITS)
        ('µs', 1e-06)
    """
    finite = [v for v in values if math.isfinite(v)]
    largest = max(finite, default=0.0)
    for name, factor in units:
        if largest / factor >= 0.1:
            return name, factor
    return units[-1]


def _span(seconds: tuple[float, float], per: float, compiled: bool) -> str:
    """A step time's range in the step column's unit, 13 characters wide."""
    if not compiled:
        return f"{'-':>13}"
    low, high = (value / per for value in seconds)
    return f"{f'{low:.3f}-{high:.3f}':>13}"


def _duration(seconds: float) -> str:
    """``seconds`` in the unit ``unit_for`` picks, three significant figures."""
    name, factor = unit_for([seconds], TIME_UNITS)
    return f"{seconds / factor:.3g} {name}"


ACTIVATION_NAMES = ("batch", "length")
"""Logical names of activations' dimensions, which no parameter has."""


def _idle(m: Any) -> str:
    """Why a layout's model or FSDP axis is idle, and how to put it to work."""
    sizes = m.layout.axis_sizes
    named = ", ".join(f"{axis}={sizes[axis]}" for axis in m.idle_axes)
    wasted = [axis for axis in m.idle_axes if axis not in m.layout.data_axes]
    effect = (
        "its devices repeat the same work (ranked after the layouts that use every axis)"
        if wasted
        else "it is only more data parallelism"
    )
    rules = m.layout.rules
    table = {} if rules is None or rules.logical is None else dict(rules.logical)
    names = sorted(
        name
        for name, axes in table.items()
        if name not in ACTIVATION_NAMES
        and set(m.idle_axes) & set((axes,) if isinstance(axes, str) else axes or ())
    )
    if names:  # the rules map logical names to the axis, but no dimension divides
        return (
            f"{named} shards no parameter, so {effect}: no dimension named "
            f"{' or '.join(names)} divides evenly by its size (such a dimension is left "
            "unsharded); choose a size that divides them"
        )
    return (
        f"{named} shards no parameter, so {effect}; the model's parameters carry no logical "
        "axis names for it: annotate them (nn.with_logical_partitioning, as meshkit.models "
        "do) and plan with rules that map those names, or leave the axis out"
    )


def _figure(value: float, spec: str, known: bool) -> str:
    """``value`` formatted to ``spec``'s width, or a dash where no program gave it."""
    width = int(spec.split(".", maxsplit=1)[0])
    return format(value, spec) if known else "-".rjust(width)


def describe_choice(plan: Plan) -> str:
    """One line on the chosen layout and why: memory to spare, step time, what bounds it.

    When nothing fits, the ``NoLayoutFitsError`` message instead: the closest layout,
    its overshoot per device and what would make it fit.
    """
    try:
        best = plan.best
    except ValueError as error:  # NoLayoutFitsError: the closest layout and the fixes
        return str(error)
    spare = (best.capacity_bytes - best.measurement.total_bytes) / GiB
    runner_up = next((r for r in plan.reports[1:] if r.fits), None)
    versus = (
        ""
        if runner_up is None
        else f"; next best {runner_up.layout.name} at {_duration(runner_up.estimated_step_seconds)}"
    )
    return (
        f"chosen: {best.layout.name} - fits with {spare:.2f} GiB to spare, estimated "
        f"{_duration(best.estimated_step_seconds)} per step "
        f"({_duration(best.step_seconds_range[0])} to {_duration(best.step_seconds_range[1])}, "
        f"bound by {best.bottleneck}), "
        f"MFU {best.estimated_mfu:.0%} (HFU {best.estimated_hfu:.0%}){versus}"
    )


def write_plan_json(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Writes ``plan.to_json()`` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return path


def plot_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """A PNG of stacked bytes per device for each layout, beside the chip's capacity, the
    chosen layout outlined and each layout's estimated step time (diamonds, right axis).

    Needs matplotlib (``pip install "meshkit[recipes]"``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'plot_plan needs matplotlib: pip install "meshkit[recipes]" (or matplotlib).'
        ) from error
    reports = plan.reports
    names = [report.layout.name for report in reports]
    unit, per = unit_for([r.measurement.total_bytes for r in reports], BYTE_UNITS)
    parts = {
        "parameters": [r.measurement.params_bytes / per for r in reports],
        "optimizer state": [r.measurement.optimizer_bytes / per for r in reports],
        "temporaries": [r.measurement.temp_bytes / per for r in reports],
        "other (batch, outputs)": [
            max(
                r.measurement.total_bytes
                - r.measurement.params_bytes
                - r.measurement.optimizer_bytes
                - r.measurement.temp_bytes,
                0,
            )
            / per
            for r in reports
        ],
    }
    # A Figure of its own, not pyplot's: the caller's backend and open figures stay as
    # they are (a notebook keeps showing its plots inline).
    upright = len(names) <= 10  # labels side by side, else slanted to fit many layouts
    width = 1.7 * len(names) + 1.5 if upright else 0.6 * len(names) + 2.0
    figure = Figure(figsize=(max(6.5, width), 5.0 if upright else 6.0), layout="constrained")
    axes = figure.subplots()
    bottom = [0.0] * len(names)
    for label, values in parts.items():
        axes.bar(range(len(names)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    capacity = reports[0].capacity_bytes / per
    on_scale = capacity <= 3 * max(bottom)
    if on_scale:  # on the bars' scale: a line
        axes.axhline(capacity, color="black", linestyle="--", label="usable per chip")
    else:  # far above a small model's bars, which a line there would flatten
        axes.set_title(f"usable per chip: {capacity:,.0f} {unit}, off this scale", fontsize=8)
    chosen = 0 if reports and reports[0].fits else None
    if chosen is not None:  # the plan's choice, outlined, with its name above the bar
        axes.bar(chosen, bottom[chosen], fill=False, edgecolor="black", linewidth=2)
        axes.annotate("chosen", (chosen, bottom[chosen]), ha="center", va="bottom", fontsize=7)
    labels = [name.replace(" ", "\n") for name in names]  # the mesh, then its remat policy
    if upright:
        axes.set_xticks(range(len(names)), labels, fontsize=7)
    else:
        axes.set_xticks(range(len(names)), names, fontsize=7, rotation=60, ha="right")
    axes.set_ylabel(f"{unit} per device")
    figure.suptitle(f"{plan.target.devices} x {plan.target.chip.description}")
    times = axes.twinx()  # the estimated step time of every layout the compiler compiled
    _plot_step_times(times, reports)
    tallest = max([*bottom, capacity if on_scale else 0.0])
    axes.set_ylim(0, (tallest or 1.0) * 1.15)  # headroom for the "chosen" mark
    handles, legend_labels = axes.get_legend_handles_labels()
    more, more_labels = times.get_legend_handles_labels()
    figure.legend(  # below the plot: nothing drawn under it
        handles + more, legend_labels + more_labels, loc="outside lower center", ncol=3, fontsize=7
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _plot_step_times(axes: Any, reports: list[Any]) -> None:
    """Each compiled layout's estimated step time and its range, as diamonds on ``axes``."""
    known = [(i, r) for i, r in enumerate(reports) if not r.measurement.error]
    time_unit, per_time = unit_for([r.estimated_step_seconds for _, r in known], TIME_UNITS)
    if known:
        steps = [r.estimated_step_seconds for _, r in known]
        below = [r.estimated_step_seconds - r.step_seconds_range[0] for _, r in known]
        above = [r.step_seconds_range[1] - r.estimated_step_seconds for _, r in known]
        axes.errorbar(
            [i for i, _ in known],
            [step / per_time for step in steps],
            yerr=[[b / per_time for b in below], [a / per_time for a in above]],
            fmt="kD",
            markersize=4,
            capsize=3,
            label="step time and its range (right)",
        )
    slowest = max((r.step_seconds_range[1] / per_time for _, r in known), default=1.0)
    axes.set_ylim(0, slowest * 1.15)  # headroom above the slowest range
    axes.set_ylabel(f"estimated {time_unit} per step")
