"""XLA:GPU on a machine without a GPU: a compile-only CUDA topology for the planner.

JAX's CUDA plugin (``jax-cuda12-plugin``, no CUDA libraries needed) can describe a set
of GPUs it does not have when it is given their properties as a ``GpuTargetConfigProto``
(the ``target_config`` option of ``jax.experimental.topologies.get_topology_desc``) and a
shape ``"<slices>x<hosts>x<gpus per host>"``; programs compiled for its devices are
XLA:GPU's own, with XLA:GPU's fusion, rematerialisation and buffer assignment, so
their memory figures are the GPU's rather than XLA:CPU's. Without a GPU XLA cannot
autotune or run ``cost_analysis``, so the planner counts FLOPs from the program's
products (``_hlo``).

The device properties below are the makers' published figures for each chip: the
number of streaming multiprocessors, their clock, shared memory and L2 size, memory
size and bandwidth, and the compute capability (NVIDIA's data sheets and CUDA
programming guide, "Compute Capabilities").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshkit._plugins import cuda_plugin_installed


@dataclasses.dataclass(frozen=True)
class GpuProperties:
    """What XLA:GPU needs to know of a chip to compile for it (its device description)."""

    name: str  # as the driver reports it
    multiprocessors: int
    clock_ghz: float
    compute_capability: tuple[int, int]
    shared_memory_per_multiprocessor: int  # bytes
    shared_memory_per_block_optin: int  # bytes
    l2_cache_bytes: int
    memory_bytes: int
    memory_bytes_per_second: float


GPUS: dict[str, GpuProperties] = {
    # GH100 in the SXM5 module: 132 SMs, 228 KB of shared memory per SM (227 KB per
    # block), 50 MB L2, 80 GB HBM3 at 3.35 TB/s, compute capability 9.0.
    "h100": GpuProperties("NVIDIA H100 80GB HBM3", 132, 1.98, (9, 0), 233472, 232448,
                          50 * 2**20, 80 * 10**9, 3.35e12),
    # The same GH100 with 141 GB of HBM3e at 4.8 TB/s.
    "h200": GpuProperties("NVIDIA H200", 132, 1.98, (9, 0), 233472, 232448,
                          50 * 2**20, 141 * 10**9, 4.8e12),
    # GA100 in the SXM4 module: 108 SMs, 164 KB of shared memory per SM (163 KB per
    # block), 40 MB L2, 80 GB HBM2e at 2.039 TB/s, compute capability 8.0.
    "a100": GpuProperties("NVIDIA A100-SXM4-80GB", 108, 1.41, (8, 0), 167936, 166912,
                          40 * 2**20, 80 * 10**9, 2.039e12),
}  # fmt: skip


def target_config(chip: GpuProperties) -> str:
    """``chip`` as the text form of XLA's ``GpuTargetConfigProto``.

    Examples:
        >>> print(target_config(GPUS["h100"]).splitlines()[1].strip())
        threads_per_block_limit: 1024
    """
    major, minor = chip.compute_capability
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024,
        "shared_memory_per_core": chip.shared_memory_per_multiprocessor,
        "threads_per_core_limit": 2048,
        "core_count": chip.multiprocessors,
        "fpus_per_core": 128 if major >= 9 else 64,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(chip.memory_bytes_per_second),
        "l2_cache_size": chip.l2_cache_bytes,
        "clock_rate_ghz": chip.clock_ghz,
        "device_memory_size": chip.memory_bytes,
        "shared_memory_per_block_optin": chip.shared_memory_per_block_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    lines = ["gpu_device_info {", *(f"  {key}: {value}" for key, value in info.items())]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
    lines += ['platform_name: "CUDA"', f'device_description_str: "{chip.name}"']
    return "\n".join(lines) + "\n"


def gpu_devices(accelerator: str, devices: int, slices: int) -> list[Any]:
    """``devices`` compile-only GPUs of kind ``accelerator``, ``slices`` nodes of them."""
    if accelerator not in GPUS:
        raise ValueError(
            f"compiler='gpu' knows the GPUs {sorted(GPUS)}, not {accelerator!r}; plan "
            "it with compiler='cpu'."
        )
    if not cuda_plugin_installed():
        raise RuntimeError(
            "compiler='gpu' compiles with XLA:GPU through JAX's CUDA plugin, which is not "
            'installed: pip install "meshkit[gpu-plan]" (jax-cuda12-plugin at the '
            "installed jax version; no GPU or CUDA libraries needed), or plan with "
            "compiler='cpu'."
        )
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(GPUS[accelerator]),
            topology=f"1x{slices}x{devices // slices}",
        )
    except Exception as error:
        raise RuntimeError(
            f"JAX's CUDA plugin could not describe {devices} x {accelerator} ({error}). "
            "Its version must be the installed jax's; or plan with compiler='cpu'."
        ) from error
    return sorted(topology.devices, key=lambda d: d.id)
