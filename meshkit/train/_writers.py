"""Where ``fit``'s records go: ``metrics.jsonl`` always, TensorBoard and W&B on request.

A writer gets the records process 0 makes at log and evaluation boundaries: a step
and a flat mapping of names to floats (``loss``, ``accuracy``, ``learning_rate``,
``steps_per_second``, ``eval/accuracy``...). ``start(step)`` is called once before the
first record: a run resumed from a checkpoint at ``step`` drops the records an earlier
run made after it, so every step is recorded once, by the run that kept it.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Mapping
from typing import IO, Any, Protocol, runtime_checkable

from meshkit._paths import (
    PathLike,
    as_path,
    check_store_packages,
    is_remote,
    write_text_atomically,
)


@runtime_checkable
class MetricWriter(Protocol):
    """What ``fit(writers=...)`` accepts: ``start``, ``write`` and ``close``."""

    def start(self, step: int) -> None:
        """The run starts after ``step`` (0, or the step it resumed from)."""
        ...

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Records ``values`` (floats, or lists of floats) at ``step``."""
        ...

    def close(self) -> None:
        """Flushes and releases the writer; it is not written to again."""
        ...


def _step_of(line: str) -> float:
    """The step a ``metrics.jsonl`` line records; infinite for a line cut short by a kill."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _optional_package(name: str, writer: str, extra: str) -> Any:
    """The optional package ``name`` a writer needs, or an error naming the extra to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(
            f'{writer} needs the {name} package: pip install "meshkit[{extra}]" '
            f"(or pip install {name})."
        ) from None


def scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """``values`` flattened to scalars: a list value ``v`` under ``name`` gives ``name/0``...

    Examples:
        >>> scalars({"loss": 0.5, "member_loss": [1.0, 2.0]})
        {'loss': 0.5, 'member_loss/0': 1.0, 'member_loss/1': 2.0}
    """
    flat: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, list | tuple):
            for index, item in enumerate(value):
                flat.update(scalars({f"{name}/{index}": item}))
        elif isinstance(value, int | float):
            flat[name] = float(value)
    return flat


class JsonlWriter:
    """One JSON line per record (``{"step": ..., **values, "time": ...}``).

    On a local disk each line is appended and flushed as written, so a killed run keeps
    every record it made. An object store (``gs://``...) cannot append, so there the
    file is rewritten whole every ``flush_seconds`` and at ``close``: a kill loses at
    most that much. ``start`` drops the lines of steps after a resumed run's
    checkpoint, and a line cut short by a kill, by rewriting the file atomically.
    """

    def __init__(self, path: PathLike, *, flush_seconds: float = 30.0):
        self.path = as_path(path)
        self.remote = is_remote(path)
        self.flush_seconds = flush_seconds
        self._file: IO[str] | None = None
        self._lines: list[str] = []  # an object store's whole file
        self._flushed = time.monotonic()

    def start(self, step: int) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) <= step]
        if self.remote:
            self._lines = kept  # rewritten whole from now on
        if len(kept) < len(lines):
            self._rewrite(kept)

    def _rewrite(self, lines: list[str]) -> None:
        write_text_atomically(self.path, "".join(lines))
        self._flushed = time.monotonic()

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        line = json.dumps({"step": step, **values, "time": time.time()}) + "\n"
        if self.remote:
            self._lines.append(line)
            if time.monotonic() - self._flushed >= self.flush_seconds:
                self._rewrite(self._lines)
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.remote and self._lines:
            self._rewrite(self._lines)


class TensorBoardWriter:
    """Scalars in a TensorBoard event file under ``logdir`` (needs ``tensorboardX``).

    Install it with ``pip install "meshkit[tensorboard]"``. A resumed run starts its
    event file with a purge marker at the step after its checkpoint, so TensorBoard
    hides what an earlier run recorded after that step. Files are created on the first
    record, so a writer built on every process only writes from process 0.

    Examples:
        >>> import tempfile
        >>> writer = TensorBoardWriter(tempfile.mkdtemp())
        >>> writer.start(0)
        >>> writer.write(10, {"loss": 0.25, "eval/accuracy": 0.9})
        >>> writer.close()
    """

    def __init__(self, logdir: PathLike, *, flush_seconds: float = 30.0):
        self.logdir = as_path(logdir)
        self.flush_seconds = flush_seconds
        self._start: int | None = None
        self._writer: Any = None

    def start(self, step: int) -> None:
        """Checks, before training starts, what the first record would need."""
        self._start = step
        _optional_package("tensorboardX", "TensorBoardWriter", "tensorboard")
        check_store_packages(self.logdir, what="TensorBoard logdir")
        if not is_remote(self.logdir) and self.logdir.exists() and not self.logdir.is_dir():
            raise NotADirectoryError(
                f"The TensorBoard logdir {self.logdir} is a file; TensorBoard writes event "
                "files into a folder. Pass a folder's path, or move that file away."
            )

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        if self._writer is None:
            tensorboardx = _optional_package("tensorboardX", "TensorBoardWriter", "tensorboard")
            self._writer = tensorboardx.SummaryWriter(
                str(self.logdir),
                purge_step=self._start + 1 if self._start else None,
                flush_secs=int(self.flush_seconds),
            )
        for name, value in scalars(values).items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter:
    """Records in a Weights & Biases run (needs ``wandb``); offline by default.

    Offline runs are written under ``directory`` and uploaded later with ``wandb sync``;
    pass ``mode="online"`` to stream them. The run is started on the first record, so
    a writer built on every process only logs from process 0. ``config`` (e.g. a
    recipe's ``run_config``) is stored with the run.
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        project: str = "meshkit",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: str = "offline",
    ):
        self.directory = as_path(directory)
        self.project = project
        self.name = name
        self.config = dict(config or {})
        self.mode = mode
        self._start = 0
        self._run: Any = None

    def start(self, step: int) -> None:
        self._start = step

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        if self._run is None:
            wandb = _optional_package("wandb", "WandbWriter", "wandb")
            self.directory.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=self.project,
                name=self.name,
                dir=str(self.directory),
                config={**self.config, "resumed_from": self._start or None},
                mode=self.mode,
            )
        self._run.log(scalars(values), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
