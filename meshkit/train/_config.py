"""What a run was started with: its arguments, mesh, devices and package versions."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from collections.abc import Collection, Mapping
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


RESUMABLE_ARGUMENTS = frozenset(
    {
        "steps", "num_steps", "workdir", "log_every", "eval_every", "checkpoint_every",
        "no_progress", "progress", "tensorboard", "profile_steps", "fresh",
        "mesh", "cpu_devices", "input", "steps_per_dispatch", "threads", "workers",
    }
)  # fmt: skip
"""Arguments a resumed run may change: how long it runs, what it records and how often,
and where and how it computes (the mesh, the input path, the steps per dispatch),
none of which changes what is trained. Any other difference stops a resume."""


def write_run_config(
    workdir: PathLike,
    arguments: Mapping[str, Any] | argparse.Namespace,
    mesh: Mesh,
    *,
    may_change: Collection[str] = RESUMABLE_ARGUMENTS,
    resuming: bool | None = None,
) -> epath.Path:
    """Writes what a run was started with as ``<workdir>/config.json`` (on process 0),
    after checking that a run it resumes was started with the same settings.

    The record holds ``arguments`` (an ``argparse.Namespace`` or a mapping; paths
    become strings), the command line, the mesh's axes, the device platform, kind and
    count, the process count, and the versions of Python and of meshkit, jax, jaxlib,
    flax, optax, orbax-checkpoint, grain and numpy. Returns the file's path.

    When ``workdir`` already holds a checkpoint (``resuming=None``: one in
    ``<workdir>/checkpoints``; ``True``: a run of another kind, such as a sweep, says
    so itself) and a ``config.json``, the run would resume: its recorded arguments
    are compared with these, and any
    difference outside ``may_change`` (``RESUMABLE_ARGUMENTS``: the step count, the
    records, the mesh and input path) stops the start with a ``ValueError`` naming
    each one, before anything trains. A resumed run then writes the file again.

    Raises:
      ValueError: a run in ``workdir`` was started with other settings; the message
        names each difference and the two ways out.

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
    if resuming is None:
        resuming = latest_checkpoint_step(workdir) is not None
    if resuming and path.exists():
        recorded = json.loads(path.read_text()).get("arguments", {})
        _check_same_run(workdir, recorded, config["arguments"], may_change)
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(config, indent=2) + "\n")
    return path


def latest_checkpoint_step(workdir: PathLike) -> int | None:
    """The newest step saved in ``<workdir>/checkpoints``, or ``None`` without one."""
    directory = as_path(workdir) / "checkpoints"
    if not directory.exists():
        return None
    steps = [int(child.name) for child in directory.iterdir() if child.name.isdigit()]
    return max(steps, default=None)


def _check_same_run(
    workdir: PathLike,
    recorded: Mapping[str, Any],
    given: Mapping[str, Any],
    may_change: Collection[str],
) -> None:
    """Raises naming every argument that differs from the run ``workdir`` holds."""
    names = sorted((set(recorded) | set(given)) - set(may_change))
    changed = [
        f"{name} {_shown(recorded, name)} (now {_shown(given, name)})"
        for name in names
        if recorded.get(name, _UNSET) != given.get(name, _UNSET)
    ]
    if changed:
        raise ValueError(
            f"{workdir} holds a run started with other settings: {', '.join(changed)}. "
            "Resuming would train one run with two configurations. To resume it, pass its "
            "settings again; to start a new run, use another workdir (--workdir DIR), or "
            "--fresh to delete this run's checkpoints first."
        )


_UNSET = object()


def _shown(arguments: Mapping[str, Any], name: str) -> str:
    return json.dumps(arguments[name]) if name in arguments else "unset"
