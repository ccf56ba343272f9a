"""What a run was started with: its arguments, mesh, devices and package versions."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath
from jax.sharding import Mesh

from meshkit._paths import PathLike, as_path, check_store_packages, write_text_atomically

PACKAGES = ("meshkit", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")
"""The packages whose versions a run's ``config.json`` records."""


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: paths and other objects as strings."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return str(value)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_config(arguments: Mapping[str, Any] | argparse.Namespace, mesh: Mesh) -> dict[str, Any]:
    """A JSON-ready record of a run: ``arguments`` and where and with what it ran.

    Holds the arguments (an ``argparse.Namespace`` or a mapping; paths become strings),
    the command line, the mesh's axes, the device platform, kind and count, the
    process count, and the versions of Python and of ``PACKAGES``.

    Examples:
        >>> import meshkit
        >>> config = run_config({"learning_rate": 0.1}, meshkit.make_mesh("data=-1"))
        >>> config["arguments"], config["devices"]["platform"], "jax" in config["versions"]
        ({'learning_rate': 0.1}, 'cpu', True)
    """
    if isinstance(arguments, argparse.Namespace):
        arguments = vars(arguments)
    device = jax.devices()[0]
    return {
        "arguments": _jsonable(dict(arguments)),
        "command": list(sys.argv),
        "mesh": {str(name): int(size) for name, size in mesh.shape.items()},
        "devices": {
            "platform": device.platform,
            "kind": device.device_kind,
            "count": jax.device_count(),
            "per_process": jax.local_device_count(),
        },
        "processes": jax.process_count(),
        "versions": {"python": platform.python_version()}
        | {package: _version(package) for package in PACKAGES},
    }


def write_run_config(
    workdir: PathLike, arguments: Mapping[str, Any] | argparse.Namespace, mesh: Mesh
) -> epath.Path:
    """Writes what a run was started with as ``<workdir>/config.json`` (on process 0).

    The record holds ``arguments`` (an ``argparse.Namespace`` or a mapping; paths
    become strings), the command line, the mesh's axes, the device platform, kind and
    count, the process count, and the versions of Python and of meshkit, jax, jaxlib,
    flax, optax, orbax-checkpoint, grain and numpy. A resumed run writes it again: the
    file describes the latest start. Returns the file's path.

    Examples:
        >>> import json, tempfile, meshkit
        >>> path = write_run_config(tempfile.mkdtemp(), {"learning_rate": 0.1},
        ...                         meshkit.make_mesh("data=-1"))
        >>> config = json.loads(path.read_text())
        >>> config["arguments"], config["devices"]["platform"], "jax" in config["versions"]
        ({'learning_rate': 0.1}, 'cpu', True)
    """
    check_store_packages(workdir)  # the first write of a recipe: say so before it fails
    config = run_config(arguments, mesh)
    path = as_path(workdir) / "config.json"
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(config, indent=2) + "\n")
    return path
