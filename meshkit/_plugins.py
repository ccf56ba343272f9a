"""JAX's accelerator plugins on a machine without their chips.

``meshkit[tpu]`` (libtpu) and ``meshkit[gpu-plan]`` (JAX's CUDA plugin) are installed
to plan for chips a machine does not have. Started as JAX starts them, each fails there
and says so: libtpu in five lines about a metadata server, the CUDA plugin in a
20-line traceback. ``meshkit.distributed.initialize`` starts such a machine on its CPU
(``cpu_only_without_accelerators``); the planner quiets them in its own way
(``meshkit.plan``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import jax

CUDA_PLUGIN = "jax_plugins.xla_cuda12"
"""The module of JAX's CUDA plugin, which ``meshkit[gpu-plan]`` installs for XLA:GPU plans."""


def has_tpu_devices() -> bool:
    """Whether this machine has TPU chips (their device files: ``/dev/accel*`` or
    ``/dev/vfio``)."""
    dev = Path("/dev")
    return any(dev.glob("accel*")) or (dev / "vfio").exists()


def has_nvidia_gpus() -> bool:
    """Whether this machine has NVIDIA GPUs (``/dev/nvidia0``...)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def libtpu_installed() -> bool:
    """Whether libtpu is installed (``meshkit[tpu]``: the TPU compiler, no TPU needed)."""
    return importlib.util.find_spec("libtpu") is not None


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (it needs no GPU to describe one)."""
    try:
        return importlib.util.find_spec(CUDA_PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def _other_plugins() -> set[str]:
    """JAX plugins other than the CUDA one (Metal, ROCm...): their entry points."""
    names = {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
    return {name for name in names if not name.startswith("xla_cuda")}


def idle_plugins() -> list[str]:
    """The installed accelerator plugins whose chips this machine lacks: ``"tpu"``,
    ``"cuda"``."""
    idle = ["tpu"] * (libtpu_installed() and not has_tpu_devices())
    return idle + ["cuda"] * (cuda_plugin_installed() and not has_nvidia_gpus())


def cpu_only_without_accelerators() -> bool:
    """Starts JAX on the CPU alone (``jax_platforms="cpu"``) where its only accelerator
    plugins are idle ones (libtpu without TPUs, the CUDA plugin without GPUs): JAX would
    end there anyway, after each plugin's failure to start. A choice of platforms
    already made (``JAX_PLATFORMS``, ``jax_platforms``) is kept. Returns whether it
    chose.

    Examples:
        >>> cpu_only_without_accelerators()  # no idle plugin on a plain install
        False
    """
    if os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None):
        return False
    if not idle_plugins() or _other_plugins():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
