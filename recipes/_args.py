"""The command-line options every recipe shares, defined once."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def recipe_parser(
    doc: str | None, *, workdir: str | None = None, progress: bool = False
) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with the shared options.

    Every recipe gets ``--cpu-devices`` (fake CPU devices per process, from
    ``JAX_NUM_CPU_DEVICES`` or 8); with ``workdir``, ``--workdir`` defaulting to it;
    with ``progress``, ``--no-progress`` to turn the progress bar off.
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    if workdir is not None:
        parser.add_argument("--workdir", type=Path, default=Path(workdir))
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", "8")),
        help="fake CPU devices per process (only used on the CPU backend)",
    )
    if progress:
        parser.add_argument("--no-progress", action="store_true")
    return parser
