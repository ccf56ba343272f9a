"""Rank candidate layouts: memory per device against capacity, and an estimated step time."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshkit._rules import FSDP, PartitionRules
from meshkit.models._remat import RematPolicy
from meshkit.plan._accelerators import ACCELERATORS
from meshkit.plan._efficiency import step_seconds
from meshkit.plan._layout import Layout, Target, target_devices
from meshkit.plan._measure import Measurement, Workload, measure

GiB = 2**30


class NoLayoutFitsError(ValueError):
    """No candidate layout fits the target's memory; the message names the closest."""


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """One layout's figures per device, whether it fits, and its estimated step time.

    Attributes:
      measurement: what the compiled step needs (bytes, FLOPs, collectives).
      capacity_bytes: the memory one chip may use (``Target.usable_bytes``).
      fits: ``total_bytes`` is within ``capacity_bytes``.
      terms: the step's terms in seconds, at the rates ``Target.step_efficiency``
        says a step reaches: ``compute`` (FLOPs / achieved FLOP/s), ``memory``
        (``memory_traffic`` / HBM bandwidth), ``ici`` and ``dcn`` (collective traffic /
        achieved link bandwidth, within and across slices).
      estimated_step_seconds: ``step_seconds(max(compute, memory), ici + dcn,
        overlap)``: the collectives' share ``overlap`` of the shorter hidden under the
        longer.
      step_seconds_range: the least and most the step may take: the calibration
        runs' best compute efficiency with every collective hidden, their worst with
        none hidden.
      estimated_mfu: model FLOPs utilisation: the workload's model FLOPs (its useful
        work, ``Workload.model_flops``) / (step time × peak FLOP/s × devices).
      estimated_hfu: hardware FLOPs utilisation: the FLOPs the compiled program runs
        (recomputation included) / (step time × peak FLOP/s × devices).
    """

    measurement: Measurement
    capacity_bytes: int
    fits: bool
    terms: dict[str, float]
    estimated_step_seconds: float
    step_seconds_range: tuple[float, float]
    estimated_mfu: float
    estimated_hfu: float

    @property
    def layout(self) -> Layout:
        """The layout measured."""
        return self.measurement.layout

    @property
    def bottleneck(self) -> str:
        """The largest term of the step time (``compute``, ``memory``, ``ici``, ``dcn``),
        or ``"not compiled"`` when the compiler gave no program."""
        if self.measurement.error:
            return "not compiled"
        return max(self.terms, key=lambda term: self.terms[term])

    def collective_bytes(self, *, across_slices: bool | None = None) -> float:
        """Bytes one device sends per step in collectives (all, within, or across slices)."""
        return self.measurement.traffic_bytes(across_slices=across_slices)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values; byte counts are per device."""
        m = self.measurement
        by_kind: dict[str, float] = {}
        for c in m.collectives:
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.payload_bytes * c.count
        report = {
            "layout": m.layout.name,
            "axes": m.layout.axis_sizes,
            "remat": m.layout.remat,
            "microbatches": m.layout.microbatches,
            "precision": m.layout.precision,
            "layout_spec": m.layout.to_json(),
            "fits": self.fits,
            "num_params": m.num_params,
            "params_bytes_per_device": m.params_bytes,
            "optimizer_bytes_per_device": m.optimizer_bytes,
            "gradient_bytes_per_device": m.gradient_bytes,
            "batch_bytes_per_device": m.batch_bytes,
            "temp_bytes_per_device": m.temp_bytes,
            "total_bytes_per_device": m.total_bytes,
            "capacity_bytes_per_device": self.capacity_bytes,
            "collective_bytes_per_device": self.collective_bytes(),
            "collective_bytes_across_slices_per_device": self.collective_bytes(across_slices=True),
            "collective_payload_bytes_by_kind": by_kind,
            "flops_per_device": m.flops,
            "bytes_accessed_per_device": m.bytes_accessed,
            "matmul_bytes_per_device": m.matmul_bytes,
            "estimated_step_seconds": self.estimated_step_seconds,
            "step_seconds_range": list(self.step_seconds_range),
            "step_time_terms_seconds": self.terms,
            "bottleneck": self.bottleneck,
            "estimated_mfu": self.estimated_mfu,
            "estimated_hfu": self.estimated_hfu,
            "compile_seconds": m.compile_seconds,
            "compiler": m.compiler,
            "error": m.error or None,
            "idle_axes": list(m.idle_axes),
        }
        return {key: _json_number(value) for key, value in report.items()}


def _json_number(value: Any) -> Any:
    """NaN (a figure only a compiled program gives) as JSON's ``null``."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _json_number(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_number(item) for item in value]
    return value


def memory_traffic(measurement: Measurement) -> float:
    """The HBM bytes a step's memory term charges: the TPU compiler's own count, or
    (from XLA:CPU, which fuses less than GPU and TPU compilers) the products' and
    convolutions' operands and results, which no fusion avoids."""
    if measurement.compiler.startswith("XLA:TPU"):
        return measurement.bytes_accessed
    return measurement.matmul_bytes


def estimate(measurement: Measurement, target: Target, model_flops: float) -> LayoutReport:
    """The estimate of one measured layout's step on the target's chips, at the rates
    ``target.step_efficiency()`` says a step reaches."""
    chip = target.chip
    efficiency = target.step_efficiency()
    ici = measurement.traffic_bytes(across_slices=False)
    dcn = measurement.traffic_bytes(across_slices=True)
    at_peak = measurement.flops / chip.peak_flops
    links = efficiency.links
    terms = {
        "compute": at_peak / efficiency.compute,
        "memory": memory_traffic(measurement) / chip.hbm_bytes_per_second,
        "ici": ici / (chip.ici_bytes_per_second * links),
        "dcn": dcn / (chip.dcn_bytes_per_second * links),
    }
    communication = terms["ici"] + terms["dcn"]

    def step(compute: float, overlap: float) -> float:
        busy = max(at_peak / compute, terms["memory"])
        return step_seconds(busy, communication, overlap)

    low, high = efficiency.compute_range
    seconds = step(efficiency.compute, efficiency.overlap)
    span = (step(high, 1.0), step(low, 0.0))
    if measurement.error:  # no program: no step time
        seconds, span = float("nan"), (float("nan"), float("nan"))
    capacity, _ = target.usable_bytes()
    peak = seconds * chip.peak_flops * target.devices
    mfu = model_flops / peak if seconds > 0 else 0.0
    hfu = measurement.flops * target.devices / peak if seconds > 0 else 0.0
    if measurement.error:
        mfu = hfu = float("nan")
    return LayoutReport(
        measurement=measurement,
        capacity_bytes=capacity,
        # The TPU compiler refuses what passes its own limit: a program is one that fits.
        fits=not measurement.error
        and (measurement.compiler.startswith("XLA:TPU") or measurement.total_bytes <= capacity),
        terms=terms,
        estimated_step_seconds=seconds,
        step_seconds_range=span,
        estimated_mfu=mfu,
        estimated_hfu=hfu,
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate's report, fitting layouts first, fastest first.

    Attributes:
      target: the hardware planned for.
      reports: one per candidate: the layouts that fit by estimated step time, then
        those that do not by how far they overshoot.
      dropped: the layouts left out because an axis of theirs that is not a data axis
        shards no parameter (their devices would repeat the same work); ``plan(...,
        keep_idle=True)`` keeps them, marked.
      not_planned: the candidates a Ctrl-C left uncompiled (the plan ranks the others).
    """

    target: Target
    reports: tuple[LayoutReport, ...]
    dropped: tuple[str, ...] = ()
    not_planned: tuple[str, ...] = ()

    @property
    def best(self) -> LayoutReport:
        """The fastest layout that fits (one whose model axis shards no parameter only
        when no other fits); raises ``NoLayoutFitsError`` when none does."""
        if self.reports and self.reports[0].fits:
            return self.reports[0]
        raise NoLayoutFitsError(_nothing_fits(self))

    def table(self) -> str:
        """One line per layout, in rank order: GiB per device, traffic, FLOPs, step time."""
        from meshkit.plan._report import plan_table

        return plan_table(self)

    def describe_choice(self) -> str:
        """The chosen layout and why, or (when none fits) the closest and what would fit."""
        from meshkit.plan._report import describe_choice

        return describe_choice(self)

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Writes ``to_json()`` to ``path`` (parents created); ``load_layout`` reads it."""
        from meshkit.plan._report import write_plan_json

        return write_plan_json(self, path)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """A PNG of bytes per device for each layout, stacked, beside the usable capacity."""
        from meshkit.plan._report import plot_plan

        return plot_plan(self, path)

    def to_json(self) -> dict[str, Any]:
        """The target and every report, as plain JSON values."""
        chip = self.target.chip
        return {
            "target": {
                **dataclasses.asdict(self.target),
                "chip": chip.description,
                "hbm_bytes": chip.hbm_bytes,
            },
            "layouts": [report.to_json() for report in self.reports],
            "dropped": list(self.dropped),
            "not_planned": list(self.not_planned),
        }


def _nothing_fits(plan: Plan) -> str:
    closest = plan.reports[0]
    m = closest.measurement
    if _not_compiled(m):  # ranked last: no layout has a size at all
        return (
            f"No candidate layout could be compiled for {plan.target.devices} x "
            f"{plan.target.accelerator}; the first, {m.layout.name!r}: {m.error}."
        )
    over = m.total_bytes - closest.capacity_bytes
    state = m.params_bytes + m.optimizer_bytes
    bigger = sorted(
        chip.name
        for chip in ACCELERATORS.values()
        if chip.usable_bytes(plan.target.memory_fraction)[0] >= m.total_bytes
    )
    fixes = []
    if m.temp_bytes > over:
        fixes.append("a stronger remat policy or more micro-batches (temporaries are "
                     f"{m.temp_bytes / GiB:.2f} GiB)")  # fmt: skip
    if state > over:
        fixes.append(f"sharding the state over more devices (parameters and optimizer "
                     f"state are {state / GiB:.2f} GiB per device)")  # fmt: skip
    fixes.append(f"chips with more memory ({', '.join(bigger) or 'none in the table'})")
    return (
        f"No candidate layout fits {plan.target.devices} x {plan.target.accelerator} "
        f"({closest.capacity_bytes / GiB:.2f} GiB usable per chip). The closest, "
        f"{m.layout.name!r}, needs {m.total_bytes / GiB:.2f} GiB per device, "
        f"{over / GiB:.2f} GiB over. What would make it fit: {'; or '.join(fixes)}."
    )


def _rank_key(report: LayoutReport) -> tuple[bool, bool, float]:
    """Fitting layouts by step time (those whose model axis shards nothing after the
    others), then those that do not fit by their overshoot, then those that failed to
    compile for another reason than memory."""
    m = report.measurement
    if report.fits:
        return (False, _wastes_an_axis(m), report.estimated_step_seconds)
    return (True, _not_compiled(m), m.total_bytes - report.capacity_bytes)


def _not_compiled(m: Measurement) -> bool:
    """Whether the layout failed to compile for another reason than memory (so its
    sizes say nothing)."""
    return bool(m.error) and "for memory" not in m.error


def plan(
    workload: Workload,
    layouts: Sequence[Layout],
    target: Target,
    *,
    progress: bool = True,
    on_report: Callable[[LayoutReport], None] | None = None,
    keep_idle: bool = False,
) -> Plan:
    """Compiles every candidate layout for the target, without allocating, and ranks them.

    Each layout's train step is lowered on abstract, sharded inputs and compiled for
    stand-in devices (fake CPU devices, or a TPU topology description); its memory
    and FLOPs come from the compiled program, its collectives from the program's HLO,
    and its step time from the target chip's published figures at the rates
    ``target.step_efficiency()`` says a step reaches.

    Args:
      workload: the model, optimizer, loss and global batch shapes.
      layouts: the candidates; each must use exactly ``target.devices`` devices.
      target: the accelerator, how many, and in how many slices.
      progress: show a progress bar over the candidates.
      on_report: called with each report as soon as its layout is compiled.
      keep_idle: keep the layouts whose model axis shards no parameter (marked, ranked
        after the others); by default they are dropped and named in ``Plan.dropped``
        (unless no other layout fits).

    Returns:
      A ``Plan``: ``plan.best`` is the fastest layout that fits.
    """
    if not layouts:
        raise ValueError("plan got no layouts; pass at least one Layout (see candidate_layouts).")
    for layout in layouts:
        if layout.num_devices != target.devices:
            raise ValueError(
                f"Layout {layout.name!r} has axes {layout.axis_sizes}, which multiply to "
                f"{layout.num_devices}, but the target has {target.devices} devices. Choose "
                f"axis sizes whose product is {target.devices}."
            )
    devices = target_devices(target)
    measurements: list[Measurement] = []
    try:
        for layout in tqdm(layouts, desc="planning", unit="layout", disable=not progress):
            measurements.append(measure(workload, layout, target, devices))
            if on_report is not None:
                on_report(
                    estimate(measurements[-1], target, measurements[-1].flops * target.devices)
                )
    except KeyboardInterrupt:  # a Ctrl-C: the layouts planned so far are the plan
        if not measurements:
            raise
    not_planned = tuple(layout.name for layout in layouts[len(measurements) :])
    _say_xla_log(measurements)
    model_flops = workload.model_flops
    if model_flops is None:
        compiled = [m.flops for m in measurements if not m.error]
        model_flops = min(compiled) * target.devices if compiled else float("nan")
    reports = [estimate(m, target, model_flops) for m in measurements]
    wasted = [r for r in reports if _wastes_an_axis(r.measurement)]
    if keep_idle or not any(r.fits for r in reports if r not in wasted):
        wasted = []  # asked for, or nothing else fits: kept, marked and ranked last
    kept = [r for r in reports if r not in wasted]
    dropped = tuple(r.layout.name for r in wasted)
    return Plan(target, tuple(sorted(kept, key=_rank_key)), dropped, not_planned)


def _wastes_an_axis(m: Measurement) -> bool:
    """Whether an axis of the layout that is not a data axis shards no parameter."""
    return any(axis not in m.layout.data_axes for axis in m.idle_axes)


def _names(measurements: Sequence[Measurement]) -> str:
    """The layouts' names, the first three and a count where there are more than four."""
    shown = measurements if len(measurements) <= 4 else measurements[:3]
    names = ", ".join(m.layout.name for m in shown)
    if len(shown) < len(measurements):
        names += f" and {len(measurements) - len(shown)} more"
    return names


def _say_xla_log(measurements: Sequence[Measurement]) -> None:
    """XLA's compile-time alarms and resharding warnings of the whole plan, a line each
    (each warning is hundreds of characters and came once per tensor; each alarm a
    paragraph)."""
    _say_in_one_line(
        measurements,
        lambda m: m.compile_alarms,
        "XLA said %d time(s) that compiling took long (constant folding or a slow compile; "
        "its slow_operation_alarm) in %d layout(s): %s. It concerns the compile time only, "
        "not the figures.",
    )
    _say_in_one_line(
        measurements,
        lambda m: m.resharding_warnings,
        'XLA replicated a tensor it could not reshard efficiently (%d "Involuntary full '
        'rematerialization" warnings) in %d layout(s): %s. Their memory and traffic include '
        'it; see docs/planning.md, "XLA\'s resharding warnings".',
    )


def _say_in_one_line(
    measurements: Sequence[Measurement], count: Callable[[Measurement], int], message: str
) -> None:
    """Logs ``message`` with how many lines ``count`` gives in all, in how many layouts,
    and their names; nothing where there are none."""
    said = [m for m in measurements if count(m)]
    if said:
        total = sum(count(m) for m in said)
        logging.getLogger("meshkit").warning(message, total, len(said), _names(said))


LOGICAL_NAMES_MODEL_AXIS = ("mlp", "heads", "kv_heads", "vocab")
"""Logical names that tensor parallelism splits over the ``model`` axis."""


def layout_rules(*, fsdp: bool, tensor: bool, logical: bool) -> PartitionRules:
    """Rules for the standard axes ``data``, ``fsdp``, ``model``.

    With ``logical`` (a model whose parameters carry logical names, like
    ``meshkit.models.Transformer``): ``embed`` is sharded over ``fsdp``, ``mlp``,
    ``heads`` and ``vocab`` over ``model``, the batch over ``data`` and ``fsdp``.
    Without it, every leaf is FSDP-sharded over ``fsdp`` (``FSDP`` rule).
    """
    if not logical:
        return PartitionRules.fsdp("fsdp") if fsdp else PartitionRules()
    table: dict[str, Any] = dict.fromkeys(("kv", "length", "layers"))
    table["batch"] = ("data", "fsdp") if fsdp else "data"
    table["embed"] = "fsdp" if fsdp else None
    for name in LOGICAL_NAMES_MODEL_AXIS:
        table[name] = "model" if tensor else None
    default = FSDP("fsdp") if fsdp else PartitionRules().default
    return PartitionRules(logical=table, default=default)


def candidate_layouts(
    devices: int,
    *,
    tensor: Iterable[int] = (1, 2, 4, 8),
    fsdp: Iterable[int] | None = None,
    remat: Iterable[RematPolicy] = ("none",),
    microbatches: Iterable[int] = (1,),
    precision: str = "bf16",
    logical: bool = True,
    slices: int = 1,
) -> list[Layout]:
    """Layouts over axes ``data × fsdp × model`` that use exactly ``devices`` devices.

    Every ``model`` size in ``tensor`` that divides the devices per slice (tensor
    parallelism stays within a node or slice), every ``fsdp`` size (default: every
    power of two that divides what is left within a slice), ``data`` taking the rest,
    times every remat policy and micro-batch count. With several slices, the slices
    go on ``data`` (only data parallelism crosses the slower network).

    Examples:
        >>> [layout.name for layout in candidate_layouts(8, tensor=(1, 2), fsdp=(1, 8))]
        ['data=8,fsdp=1,model=1', 'data=1,fsdp=8,model=1', 'data=4,fsdp=1,model=2']
    """
    per_slice = devices // slices
    layouts = []
    for model in tensor:
        if per_slice % model:
            continue
        rest = per_slice // model
        sizes = (
            fsdp
            if fsdp is not None
            else [2**k for k in range(rest.bit_length()) if rest % 2**k == 0]
        )
        for shard in sizes:
            if rest % shard:
                continue
            axes = {"data": devices // (model * shard), "fsdp": shard, "model": model}
            rules = layout_rules(fsdp=shard > 1, tensor=model > 1, logical=logical)
            for policy in remat:
                for count in microbatches:
                    layouts.append(Layout(axes, rules, ("data", "fsdp"), policy, count, precision))
    return layouts
