"""Signals besides SIGTERM and Ctrl-C that mean "save a checkpoint and stop".

Clusters warn a job before its time limit with a signal of the job's choosing; SLURM's
``#SBATCH --signal=USR1@120`` sends SIGUSR1 to every task 120 s before the limit. A
SIGUSR1 nobody handles ends a Python process at once, so under SLURM
``meshkit.distributed.initialize()`` handles SIGUSR1 as a preemption by default: the
handler notes the request and, once ``jax.distributed`` runs, passes it on as the
SIGTERM that JAX's preemption service shares with every process, so all of them save
at the same step. ``MESHKIT_PREEMPTION_SIGNALS`` chooses the signals (``USR1,USR2``;
empty for none), anywhere.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from types import FrameType

ENV_PREEMPTION_SIGNALS = "MESHKIT_PREEMPTION_SIGNALS"
_ALWAYS = (signal.SIGTERM, signal.SIGINT)  # handled by fit itself
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)

_requested = threading.Event()
_forward_to_jax = threading.Event()  # set once JAX's preemption service runs


def preemption_signals(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The extra signals that mean "save and stop": ``MESHKIT_PREEMPTION_SIGNALS``, or
    SIGUSR1 inside a SLURM job and none elsewhere.

    Examples:
        >>> preemption_signals({"SLURM_JOB_ID": "7"})
        (<Signals.SIGUSR1: 10>,)
        >>> preemption_signals({"MESHKIT_PREEMPTION_SIGNALS": "USR1, SIGUSR2"})
        (<Signals.SIGUSR1: 10>, <Signals.SIGUSR2: 12>)
        >>> preemption_signals({"SLURM_JOB_ID": "7", "MESHKIT_PREEMPTION_SIGNALS": ""})
        ()
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_PREEMPTION_SIGNALS)
    if text is None:
        return (signal.SIGUSR1,) if "SLURM_JOB_ID" in environ else ()
    found: list[signal.Signals] = []
    for name in (part.strip().upper() for part in text.split(",")):
        if not name or name == "NONE":
            continue
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            signum = signal.Signals(int(name)) if name.isdigit() else signal.Signals[full]
        except (KeyError, ValueError):
            raise ValueError(
                f"{ENV_PREEMPTION_SIGNALS}={text!r}: {name!r} is not a signal; expected "
                "names such as USR1,USR2 (or empty for none)"
            ) from None
        if signum in _UNCATCHABLE:
            raise ValueError(
                f"{ENV_PREEMPTION_SIGNALS}={text!r}: {signum.name} cannot be caught; "
                "choose a signal a program can handle, such as USR1"
            )
        if signum not in _ALWAYS and signum not in found:
            found.append(signum)
    return tuple(found)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    name = signal.Signals(signum).name
    os.write(
        2,
        f"\n[meshkit] {name}: saving a checkpoint at the next step, then stopping "
        "(exit code 75).\n".encode(),
    )
    _requested.set()
    if _forward_to_jax.is_set():
        os.kill(os.getpid(), signal.SIGTERM)  # for JAX's preemption service


def watch(signals: tuple[signal.Signals, ...]) -> None:
    """Handles ``signals`` as preemptions (from the main thread; a program's own handler,
    or an ignored signal, is left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in signals:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_signal)


def forward_to_jax() -> None:
    """From now on a request becomes a SIGTERM for JAX's preemption service (after
    ``jax.distributed.initialize``); one that came earlier is passed on at once."""
    _forward_to_jax.set()
    if _requested.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


def requested() -> bool:
    """Whether one of the watched signals arrived (for a process without JAX's service)."""
    return _requested.is_set()
