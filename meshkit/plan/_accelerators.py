"""Published figures of the accelerators the planner estimates step times for.

Every number here is a maker's published *peak* (data sheet or documentation page),
not a measurement: real programs reach a fraction of each. Units are plain SI:
FLOP/s, bytes, bytes/s, with ``1 GB = 1e9`` bytes and ``1 GiB = 2**30`` bytes. Memory
capacities keep the unit the maker states (NVIDIA says GB; Google's TPU pages say GB
for some chips and GiB for others). Bandwidths are per chip and per direction: the
bidirectional totals that makers quote (NVLink 900 GB/s, TPU ICI "bidirectional ...
per chip") are halved, and network line rates (Gb/s) are divided by 8.
"""

from __future__ import annotations

import dataclasses
import os

_GB = 10**9
_GIB = 2**30

_H100_PAGE = "NVIDIA H100 Tensor Core GPU, https://www.nvidia.com/en-us/data-center/h100/"
_H200_PAGE = "NVIDIA H200 Tensor Core GPU, https://www.nvidia.com/en-us/data-center/h200/"
_A100_PAGE = "NVIDIA A100 Tensor Core GPU, https://www.nvidia.com/en-us/data-center/a100/"
_DGX_H100 = (
    "NVIDIA DGX H100 (8x single-port ConnectX-7, 400 Gb/s InfiniBand, one per GPU), "
    "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
)
_DGX_H200 = (
    "NVIDIA DGX H200 (8x single-port ConnectX-7, 400 Gb/s InfiniBand, one per GPU), "
    "https://www.nvidia.com/en-us/data-center/dgx-h200/"
)
_DGX_A100 = (
    "NVIDIA DGX A100 (8x single-port ConnectX-6, 200 Gb/s HDR InfiniBand, one per GPU), "
    "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html"
)
_SCALING_BOOK = (
    "How to Scale Your Model, part 2 (TPUs), https://jax-ml.github.io/scaling-book/tpus/"
)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator chip's published peak figures, and where they come from.

    Attributes:
      name: the key in ``ACCELERATORS`` (``"h100"``, ``"v5e"``, ...).
      description: the product as its maker names it (``"NVIDIA H100 SXM5 80GB"``).
      peak_flops: dense bf16 FLOP/s of one chip (no sparsity).
      hbm_bytes: memory capacity of one chip, in bytes.
      hbm_bytes_per_second: memory bandwidth of one chip.
      ici_bytes_per_second: one chip's interconnect bandwidth to the chips of its own
        slice or node (NVLink, TPU ICI), one direction.
      dcn_bytes_per_second: one chip's share of the network between slices or nodes
        (InfiniBand, the data-centre network), one direction.
      source: where each figure comes from (a data sheet or documentation page).
    """

    name: str
    description: str
    peak_flops: float
    hbm_bytes: int
    hbm_bytes_per_second: float
    ici_bytes_per_second: float
    dcn_bytes_per_second: float
    source: str

    @property
    def is_tpu(self) -> bool:
        return self.name.startswith("v")

    @property
    def family(self) -> str:
        """``"tpu"`` or ``"gpu"``: the chips whose published runs calibrate its step times."""
        return "tpu" if self.is_tpu else "gpu"

    def usable_bytes(self, fraction: float | None = None) -> tuple[int, str]:
        """The memory a program may use on one chip, and why: ``fraction`` of it when
        given; on a GPU, JAX's preallocation (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 75% by
        default), the most a JAX program gets; on a TPU, the limit XLA:TPU compiles
        against (the HBM less ``TPU_RESERVED_BYTES``)."""
        if fraction is not None:
            return int(self.hbm_bytes * fraction), f"{fraction:.0%} of the HBM, as asked"
        if self.is_tpu:
            reserve = TPU_RESERVED_BYTES / 2**30
            return (
                self.hbm_bytes - TPU_RESERVED_BYTES,
                f"the HBM less {reserve:.2f} GiB, XLA:TPU's limit",
            )
        setting = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        share = float(setting) if setting else GPU_MEMORY_FRACTION
        how = "XLA_PYTHON_CLIENT_MEM_FRACTION" if setting else "JAX's default preallocation"
        return int(self.hbm_bytes * share), f"{share:.0%} of the HBM, {how}"


GPU_MEMORY_FRACTION = 0.75
"""The share of a GPU's memory JAX preallocates and its programs may use, unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says another
(https://docs.jax.dev/en/latest/gpu_memory_allocation.html)."""

TPU_RESERVED_BYTES = 256 * 2**20
"""What XLA:TPU keeps of a chip's HBM: it compiles against 15.75 of a v5e's 16 GiB (its
out-of-memory message names the limit); the same reserve is assumed on other TPUs."""


ACCELERATORS: dict[str, Accelerator] = {
    # Hopper SXM5, 8 GPUs per NVLink/NVSwitch node.
    "h100": Accelerator(
        name="h100",
        description="NVIDIA H100 SXM5 80GB",
        peak_flops=989.5e12,
        hbm_bytes=80 * _GB,
        hbm_bytes_per_second=3.35e12,
        ici_bytes_per_second=450e9,
        dcn_bytes_per_second=50e9,
        source=(
            f"FLOP/s, HBM, NVLink: {_H100_PAGE} (H100 SXM: BF16 Tensor Core 1,979 "
            "TFLOPS with sparsity, halved for dense; 80GB; 3.35TB/s; NVLink 900GB/s "
            f"bidirectional, halved). Network: {_DGX_H100}; 400 Gb/s = 50 GB/s."
        ),
    ),
    # Ampere SXM4 80GB, 8 GPUs per NVLink/NVSwitch node.
    "a100": Accelerator(
        name="a100",
        description="NVIDIA A100 SXM4 80GB",
        peak_flops=312e12,
        hbm_bytes=80 * _GB,
        hbm_bytes_per_second=2.039e12,
        ici_bytes_per_second=300e9,
        dcn_bytes_per_second=25e9,
        source=(
            f"FLOP/s, HBM, NVLink: {_A100_PAGE} and its data sheet (A100 80GB SXM: "
            "BF16 Tensor Core 312 TFLOPS dense, 624 with sparsity; 80GB HBM2e; "
            "2,039GB/s; NVLink 600GB/s bidirectional, halved). "
            f"Network: {_DGX_A100}; 200 Gb/s = 25 GB/s."
        ),
    ),
    # Same Hopper die as the H100 with 141GB HBM3e; 8 GPUs per node.
    "h200": Accelerator(
        name="h200",
        description="NVIDIA H200 SXM 141GB",
        peak_flops=989.5e12,
        hbm_bytes=141 * _GB,
        hbm_bytes_per_second=4.8e12,
        ici_bytes_per_second=450e9,
        dcn_bytes_per_second=50e9,
        source=(
            f"FLOP/s, HBM, NVLink: {_H200_PAGE} (H200 SXM: BF16 Tensor Core 1,979 "
            "TFLOPS with sparsity, halved for dense; 141GB; 4.8TB/s; NVLink 900GB/s "
            f"bidirectional, halved). Network: {_DGX_H200}; 400 Gb/s = 50 GB/s."
        ),
    ),
    # 3D torus; 4 chips per host; the page gives no per-chip ICI or DCN figure.
    "v4": Accelerator(
        name="v4",
        description="Google Cloud TPU v4",
        peak_flops=275e12,
        hbm_bytes=32 * _GIB,
        hbm_bytes_per_second=1.2e12,
        ici_bytes_per_second=270e9,
        dcn_bytes_per_second=6.25e9,
        source=(
            "FLOP/s, HBM: Cloud TPU v4, https://cloud.google.com/tpu/docs/v4 (275 "
            "teraflops bf16 per chip; HBM2 32 GiB, 1200 GBps). ICI: not on that page; "
            f"{_SCALING_BOOK} gives 4.5e10 B/s one way per link, 6 links (3D torus) = "
            "270 GB/s one direction. Network: ASSUMPTION, no official per-chip figure; "
            "the same book's ~2.5e10 B/s of DCN per host divided by 4 chips per host "
            "= 6.25 GB/s (equal to v5p's published 50 Gbps per chip)."
        ),
    ),
    # 2D torus, 256-chip pods, 8 chips per host.
    "v5e": Accelerator(
        name="v5e",
        description="Google Cloud TPU v5e",
        peak_flops=197e12,
        hbm_bytes=16 * _GIB,
        hbm_bytes_per_second=819e9,
        ici_bytes_per_second=200e9,
        dcn_bytes_per_second=3.125e9,
        source=(
            "Cloud TPU v5e, https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 per "
            "chip; HBM2 16 GB as stated, which XLA:TPU counts as 16 GiB (its limit for a "
            "program is 15.75 GiB); 819 GBps; bidirectional ICI 400 GBps "
            "per chip, halved (an older version of the page lists 1600 Gbps = 200 GB/s). "
            "Network: the page's per-host NIC, 2 x 100 Gbps, over 8 chips per host = "
            "25 Gbps = 3.125 GB/s per chip (matches 6.4 Tbps per 256-chip pod)."
        ),
    ),
    # 3D torus, 8960-chip pods, 4 chips per host.
    "v5p": Accelerator(
        name="v5p",
        description="Google Cloud TPU v5p",
        peak_flops=459e12,
        hbm_bytes=95 * _GIB,
        hbm_bytes_per_second=2.765e12,
        ici_bytes_per_second=600e9,
        dcn_bytes_per_second=6.25e9,
        source=(
            "Cloud TPU v5p, https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 per "
            "chip; HBM 95 GiB (as stated: GiB), 2765 GBps; bidirectional ICI 1200 GBps "
            "per chip, halved (an older version of the page lists 4800 Gbps = 600 GB/s); "
            "DCN 50 Gbps per chip (a line rate, taken as one direction) = 6.25 GB/s."
        ),
    ),
    # Trillium; 2D torus, 256-chip pods, 8 chips per host.
    "v6e": Accelerator(
        name="v6e",
        description="Google Cloud TPU v6e (Trillium)",
        peak_flops=918e12,
        hbm_bytes=32 * _GB,
        hbm_bytes_per_second=1.638e12,
        ici_bytes_per_second=400e9,
        dcn_bytes_per_second=12.5e9,
        source=(
            "Cloud TPU v6e, https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16 per "
            "chip; HBM 32 GB (as stated: GB), 1638 GBps; bidirectional ICI 800 GBps "
            "per chip, halved. Network: the page's per-host NIC, 4 x 200 Gbps, over 8 "
            "chips per host = 100 Gbps = 12.5 GB/s per chip (matches 25.6 Tbps per "
            "256-chip pod)."
        ),
    ),
}
"""The accelerators the planner knows, by name."""


def accelerator(name: str) -> Accelerator:
    """Returns the published figures of the accelerator called ``name``.

    Raises:
      ValueError: ``name`` is not a key of ``ACCELERATORS``; the message lists them.
    """
    try:
        return ACCELERATORS[name]
    except KeyError:
        known = ", ".join(repr(k) for k in sorted(ACCELERATORS))
        raise ValueError(f"Unknown accelerator {name!r}: pass one of {known}.") from None
