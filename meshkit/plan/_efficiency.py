"""What fraction of a chip's published peaks a training step reaches, from published
measured runs, and how a step's compute and collectives add up.

A roofline at peak figures is a floor no real program reaches: LLM Foundry measures
its MPT models on H100s at about 41% of the peak bf16 FLOP/s (model FLOPs
utilisation), MaxText its models on TPU v5e at about 60% with every layer recomputed.
The planner's step time divides the compiled program's FLOPs (recomputation
included) by the peak times the **compute** efficiency those runs reached, the
collectives' bytes by the links' published bandwidth times **links**, and hides the
**overlap** share of the shorter of the two behind the longer.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

LLM_FOUNDRY = (
    "LLM Foundry's MPT training benchmarks, H100 80GB BF16 table "
    "(https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md): "
    "sequence 2048, amp_bf16, FSDP FULL_SHARD, flash attention, no activation checkpointing"
)
MAXTEXT_V5E = (
    "MaxText's TPU v5e configurations "
    "(https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5e/README.md "
    "and 16b.sh ... 128b.sh there): 1x v5e-256, sequence 2048, remat_policy=full, "
    "flash attention"
)

FULL_REMAT = 4 / 3
"""The hardware FLOPs of a step with every layer recomputed over its model FLOPs: the
forward pass (a third of the 6 N FLOPs per token) runs twice."""


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One measured training run whose utilisation calibrates a chip family.

    Attributes:
      name: the model and hardware (``"MPT-1B, 64 x H100"``).
      family: ``"gpu"`` or ``"tpu"``: the chips whose efficiency it calibrates.
      mfu: the run's published model FLOPs utilisation (model FLOPs / peak x time).
      recompute: hardware FLOPs over model FLOPs (1 without activation checkpointing,
        ``FULL_REMAT`` with every layer recomputed).
      source: where the figures are published.
    """

    name: str
    family: str
    mfu: float
    recompute: float
    source: str

    @property
    def compute_efficiency(self) -> float:
        """The fraction of peak FLOP/s the run's hardware FLOPs reached."""
        return self.mfu * self.recompute


def _mpt(size: str, chips: int, mfu: float) -> PublishedRun:
    return PublishedRun(f"MPT-{size}, {chips} x H100", "gpu", mfu, 1.0, LLM_FOUNDRY)


def _maxtext(size: str, mfu: float) -> PublishedRun:
    return PublishedRun(f"MaxText {size}, 256 x v5e", "tpu", mfu, FULL_REMAT, MAXTEXT_V5E)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    _mpt("760M", 16, 0.3789),
    _mpt("1B", 8, 0.4182),
    _mpt("1B", 64, 0.4085),
    _mpt("3B", 64, 0.4080),
    _mpt("7B", 8, 0.4644),
    _mpt("13B", 8, 0.3979),
    _mpt("13B", 64, 0.3986),
    _maxtext("16B", 0.6110),
    _maxtext("32B", 0.6686),
    _maxtext("64B", 0.5990),
    _maxtext("128B", 0.5606),
)
"""The runs the default efficiencies come from: every H100 BF16 row of LLM Foundry's
table at sequence 2048 without activation checkpointing for 760M, 1B, 3B, 7B and 13B
(one to eight nodes), and MaxText's four v5e models on one v5e-256 slice."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fractions of published peaks a step reaches, and how much of its collectives
    hide behind its compute.

    Attributes:
      compute: achieved FLOP/s over peak FLOP/s, on the compiled program's FLOPs.
      links: achieved collective bandwidth over the links' published bandwidth.
      overlap: the share of the shorter of compute and collectives that runs under
        the longer (0: one after the other; 1: the step takes the longer of the two).
      compute_low, compute_high: the range ``compute`` comes from (the calibration
        runs' least and most); both ``compute`` when set by hand.
      source: where the figures come from.
    """

    compute: float
    links: float = 1.0
    overlap: float = 0.5
    compute_low: float | None = None
    compute_high: float | None = None
    source: str = "set by hand"

    def __post_init__(self) -> None:
        for name in ("compute", "links", "overlap"):
            check_fraction(name, getattr(self, name), where="Efficiency")

    @property
    def compute_range(self) -> tuple[float, float]:
        """The least and most compute efficiency the estimate's range spans."""
        low = self.compute if self.compute_low is None else self.compute_low
        high = self.compute if self.compute_high is None else self.compute_high
        return low, high

    def describe(self) -> str:
        """One line for a plan's header."""
        low, high = self.compute_range
        spread = f" ({low:.0%}-{high:.0%})" if (low, high) != (self.compute, self.compute) else ""
        return (
            f"compute at {self.compute:.0%}{spread} of peak, links at {self.links:.0%}, "
            f"{self.overlap:.0%} of collectives overlapped; {self.source}"
        )


def calibrated(family: str, runs: Sequence[PublishedRun] = PUBLISHED_RUNS) -> Efficiency:
    """The efficiency of ``family``'s chips (``"gpu"`` or ``"tpu"``): the median compute
    efficiency of its published runs, their least and most as the range.

    Links run at their published bandwidth and half of the shorter of compute and
    collectives is hidden: the published runs are bound by compute (their collectives
    fit under it), so they fix neither figure; the estimate's range spans no overlap
    to full overlap.

    Examples:
        >>> gpu = calibrated("gpu")
        >>> round(gpu.compute, 4), [round(x, 4) for x in gpu.compute_range]
        (0.408, [0.3789, 0.4644])
        >>> round(calibrated("tpu").compute, 3)
        0.807
    """
    figures = [run.compute_efficiency for run in runs if run.family == family]
    if not figures:
        raise ValueError(f"No published run calibrates family {family!r}: 'gpu' or 'tpu'.")
    names = ", ".join(sorted({run.source.split(" (")[0] for run in runs if run.family == family}))
    return Efficiency(
        compute=statistics.median(figures),
        compute_low=min(figures),
        compute_high=max(figures),
        source=f"median of {len(figures)} published runs ({names})",
    )


def check_fraction(name: str, value: float, *, where: str, given: str | None = None) -> None:
    """Raises a ValueError naming ``where`` (``Efficiency`` or ``--efficiency``) and the
    value ``given`` unless ``value`` is a fraction: above 0 (``overlap``: from 0) and at
    most 1."""
    low_ok = value >= 0 if name == "overlap" else value > 0
    if not (low_ok and value <= 1):
        expected = "from 0 to 1" if name == "overlap" else "above 0 and at most 1"
        shown = value if given is None else given
        raise ValueError(
            f"{where} {name}={shown}: a fraction, {expected} (e.g. {name}=0.4 for 40%)."
        )


def parse_efficiency(text: str, family: str) -> Efficiency:
    """``--efficiency`` on the command line: ``compute=0.45,links=0.8,overlap=1`` (any of
    the three; the others keep ``family``'s calibrated values).

    Examples:
        >>> parse_efficiency("compute=0.5", "gpu").compute
        0.5
        >>> parse_efficiency("overlap=1", "tpu").overlap
        1.0
    """
    base = calibrated(family)
    fields: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("compute", "links", "overlap") or not value:
            raise ValueError(
                f"--efficiency {text!r}: expected name=fraction pairs of compute, links "
                "and overlap, e.g. compute=0.45,overlap=1."
            )
        try:
            fields[name] = float(value)
        except ValueError:
            raise ValueError(f"--efficiency {name}={value!r}: not a number.") from None
        check_fraction(name, fields[name], where="--efficiency", given=value)
    if "compute" in fields:  # a figure set by hand is not a range
        fields |= {"compute_low": fields["compute"], "compute_high": fields["compute"]}
    return dataclasses.replace(base, **fields, source=f"{base.source}; {text} by hand")


def step_seconds(busy: float, communication: float, overlap: float) -> float:
    """A step of ``busy`` seconds of compute (or memory traffic) and ``communication``
    seconds of collectives, ``overlap`` of the shorter hidden under the longer.

    Examples:
        >>> step_seconds(2.0, 1.0, 0.0), step_seconds(2.0, 1.0, 1.0), step_seconds(2.0, 1.0, 0.5)
        (3.0, 2.0, 2.5)
    """
    return busy + communication - overlap * min(busy, communication)
