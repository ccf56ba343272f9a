"""The planner's environment: libtpu on a machine without TPUs (and JAX's CUDA plugin
without GPUs) compile-only, quiet, and shared by processes.

Installing ``meshkit[tpu]`` brings libtpu, so the planner can compile for a TPU
topology on any machine. Off a TPU VM, libtpu's start-up asks the cloud's metadata
server which chips and workers it has, finds none, and prints five lines about it
(host bounds, worker hostnames, a source trace) in every process that starts JAX; and
it takes a lockfile, so a second planner on the same machine fails. Where no TPU
device is present, ``quiet_libtpu_without_tpus`` answers those questions in the
environment before JAX starts: nothing to ask, one local worker, and no chip to guard.
A variable already set is left as it is; on a TPU VM nothing is touched. Importing
``meshkit.plan`` sets them, and so does its command line, for itself and
the processes it starts; importing ``meshkit`` sets nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping

from meshkit import _plugins

COMPILE_ONLY_ENVIRONMENT = {
    "TPU_SKIP_MDS_QUERY": "1",  # no metadata server to ask off a TPU VM
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",  # host bounds: any type; topologies are named
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no chip to guard: planners may run side by side
}
"""What libtpu would otherwise look up (and complain about) when no TPU is present."""


def quiet_libtpu_without_tpus(
    environ: MutableMapping[str, str] | None = None,
    *,
    libtpu_installed: Callable[[], bool] | None = None,
    tpu_devices: Callable[[], bool] = _plugins.has_tpu_devices,
) -> bool:
    """Sets ``COMPILE_ONLY_ENVIRONMENT``'s variables that are not set yet, when libtpu is
    installed and no TPU is present; returns whether it did.

    Examples:
        >>> env = {"TPU_WORKER_ID": "3"}
        >>> quiet_libtpu_without_tpus(env, libtpu_installed=lambda: True,
        ...                           tpu_devices=lambda: False)
        True
        >>> env["TPU_SKIP_MDS_QUERY"], env["TPU_WORKER_ID"]
        ('1', '3')
        >>> quiet_libtpu_without_tpus({}, libtpu_installed=lambda: True,
        ...                           tpu_devices=lambda: True)
        False
    """
    environ = os.environ if environ is None else environ
    installed = libtpu_installed or _plugins.libtpu_installed
    if not installed() or tpu_devices():
        return False
    for name, value in COMPILE_ONLY_ENVIRONMENT.items():
        environ.setdefault(name, value)
    return True


def quiet_cuda_plugin_without_gpus(environ: MutableMapping[str, str] | None = None) -> bool:
    """With JAX's CUDA plugin installed and no NVIDIA GPU (``/dev/nvidia0``...), skips the
    plugin's check of the CUDA libraries, which fails there with a 20-line traceback at
    every JAX start (planning needs none of them); returns whether it did. A variable
    already set is left as it is."""
    environ = os.environ if environ is None else environ
    if not _plugins.cuda_plugin_installed() or _plugins.has_nvidia_gpus():
        return False
    environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return True


quiet_libtpu_without_tpus()  # on import: meshkit.plan imports this first, before JAX starts
quiet_cuda_plugin_without_gpus()
